"""The running kernel's own word on itself: the vmcoreinfo text it keeps for crash tools
(``vmcoreinfo_data``, ``vmcoreinfo_size``; lines ``OSRELEASE=6.12.117+deb12-amd64``,
``KERNELOFFSET=2a00000``, ``SYMBOL(init_uts_ns)=ffffffff...``, ``SIZE(..)``, ``OFFSET(..)``),
read from guest memory while the guest runs, and held against what was read from the image:
the release the image's banner names, the slide found from the IDT, the image's symbols at
that slide. What does not check out is one line each (``Checks.notes``); the run goes on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qmpprof.linux.kernel import LinuxKernel
from qmpprof.memory import Reader, read_ints, read_one

MAX_SIZE = 1 << 16  # the kernel keeps it in one page (VMCOREINFO_BYTES); a bound for safety
_SYMBOL = re.compile(r"SYMBOL\((\w+)\)")
_RELEASE = re.compile(rb"Linux version (\S+)")


@dataclass(frozen=True, slots=True)
class Checks:
    """What the running kernel's vmcoreinfo confirmed (``confirmed``: symbols at the same
    address) and what it did not (``notes``)."""

    confirmed: int
    notes: tuple[str, ...]


def parse(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines, the first of each key."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, equals, value = line.partition("=")
        if equals and key not in out:
            out[key] = value.strip()
    return out


async def read_vmcoreinfo(read: Reader, kernel: LinuxKernel, slide: int) -> dict[str, str] | None:
    """The running kernel's vmcoreinfo, None when the image has no such symbols or it does not
    read."""
    data, size = kernel.address("vmcoreinfo_data", slide), kernel.address("vmcoreinfo_size", slide)
    if data is None or size is None:
        return None
    pointer, length = await read_ints(read, [(data, 8), (size, 8)])
    if not pointer or not length or length > MAX_SIZE:
        return None
    raw = await read_one(read, pointer, length)
    return None if raw is None else parse(raw.decode("ascii", "replace"))


def check(info: dict[str, str], kernel: LinuxKernel, slide: int) -> Checks:
    """Hold the running kernel's ``info`` against the image at ``slide``."""
    notes: list[str] = []
    running = info.get("OSRELEASE")
    banner = _RELEASE.search(kernel.image.section(".rodata") or b"")
    release = None if banner is None else banner[1].decode("ascii", "replace")
    if running is not None and release is not None and running != release:
        notes.append(f"the guest runs Linux {running}, the image is {release}: not its kernel?")
    offset = info.get("KERNELOFFSET")
    if offset is not None and _hex(offset) not in (None, slide):
        notes.append(f"the guest's KERNELOFFSET is {offset}, the slide found {slide:#x}")
    confirmed = wrong = 0
    low, high = _image_range(kernel)
    for key, value in info.items():
        found = _SYMBOL.fullmatch(key)
        link = None if found is None else kernel.symbols.address_of(found[1])
        theirs = _hex(value)
        # Some lines hold a pointer's value, not its address (mem_section): only addresses in
        # the image are its symbols'.
        if link is None or theirs is None or not low + slide <= theirs < high + slide:
            continue
        if link + slide == theirs:
            confirmed += 1
        else:
            wrong += 1
    if wrong:
        notes.append(
            f"{wrong} of the guest's {wrong + confirmed} vmcoreinfo symbols are elsewhere in the"
            " image's symbols at this slide"
        )
    return Checks(confirmed, tuple(notes))


def _image_range(kernel: LinuxKernel) -> tuple[int, int]:
    """Link addresses from ``_text`` to ``_end``: where the image's own symbols are."""
    low = kernel.symbols.address_of("_text") or 0
    return low, kernel.symbols.address_of("_end") or max(kernel.symbols.addrs)


def _hex(text: str) -> int | None:
    try:
        return int(text, 16)
    except ValueError:
        return None
