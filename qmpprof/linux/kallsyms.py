"""The kernel's symbols from the kallsyms tables in its image (``kallsymtables`` finds them),
checked against what the image says otherwise: ``_text`` at the start of ``.text``,
``start_kernel`` and ``schedule`` in code, every ``__ksymtab`` export at its address. A decoding
that fails is passed over; when none checks out, one line says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError
from qmpprof.linux.kallsymtables import LONG_RUN, KallsymsLayout, decodings
from qmpprof.linux.symbols import KernelSymbols, parse_export_table

__all__ = [
    "CheckedKallsyms",
    "KallsymsLayout",
    "check_kallsyms",
    "decode_kallsyms",
    "locate_kallsyms",
    "read_kallsyms",
]

_TRIES = 8  # decodings read_kallsyms checks against the image before it gives up
_KNOWN_TEXT = ("start_kernel", "schedule")


@dataclass(frozen=True, slots=True)
class CheckedKallsyms:
    """A decoding the image agreed with: where its tables are, its symbols, and how many
    exports it was checked against (0: the image has none in a form that reads)."""

    layout: KallsymsLayout
    symbols: KernelSymbols
    exports: int
    refused: int  # decodings the image contradicted before this one


def read_kallsyms(image: ElfImage) -> KernelSymbols:
    """The kernel's symbols from the kallsyms tables in ``image``'s ``.rodata``, checked
    against the image; KernelImageError when there are none or none check out."""
    return check_kallsyms(image).symbols


def check_kallsyms(image: ElfImage) -> CheckedKallsyms:
    """``read_kallsyms`` with where the tables were found and what they were checked against."""
    rodata = image.section(".rodata")
    base = image.section_addr(".rodata")
    if rodata is None or base is None:
        raise KernelImageError(image.path, "no .rodata section, so no kallsyms tables")
    exports = _exports(image)
    problem = None
    for tried, (layout, symbols) in enumerate(
        islice(decodings(rodata, base, image.path, LONG_RUN), _TRIES)
    ):
        problem = _disagreement(image, symbols, exports)
        if problem is None:
            return CheckedKallsyms(layout, symbols, len(exports or ()), tried)
    raise KernelImageError(image.path, f"kallsyms tables found but {problem}")


def decode_kallsyms(data: bytes, base_addr: int, path: str = "<kernel>") -> KernelSymbols:
    """Find the tables in ``data`` (loaded at ``base_addr``) and decode every symbol."""
    return next(decodings(data, base_addr, path))[1]


def locate_kallsyms(data: bytes, base_addr: int, path: str = "<kernel>") -> KallsymsLayout:
    """The layout of the kallsyms tables in ``data``; KernelImageError when there are none."""
    return next(decodings(data, base_addr, path))[0]


def _exports(image: ElfImage) -> list[tuple[str, int]] | None:
    """The image's exported symbols (``__ksymtab``, and ``__ksymtab_gpl`` before 7.x); None
    when it has none or not in the form ``parse_export_table`` reads."""
    strings = image.section("__ksymtab_strings")
    strings_addr = image.section_addr("__ksymtab_strings")
    if strings is None or strings_addr is None:
        return None
    out: list[tuple[str, int]] = []
    for section in ("__ksymtab", "__ksymtab_gpl"):
        data, addr = image.section(section), image.section_addr(section)
        if data is not None and addr is not None:
            exports = parse_export_table(data, addr, strings, strings_addr)
            if exports is None:
                return None
            out += exports
    return out or None


def _disagreement(
    image: ElfImage, symbols: KernelSymbols, exports: list[tuple[str, int]] | None
) -> str | None:
    """What in ``symbols`` the image contradicts, in a few words; None when all agree."""
    text = symbols.address_of("_text")
    code = image.code_ranges()
    # arm64's 6.1 lists no _text (its kallsyms begin at _stext, past the Image's head): then
    # _stext must be code, as the functions below.
    if text is None and _in_code(symbols.address_of("_stext"), code):
        text = image.text_addr
    if text != image.text_addr:
        found = "missing" if text is None else f"at {text:#x}"
        return f"_text is {found}, not at the start of .text ({image.text_addr:#x})"
    for name in _KNOWN_TEXT:
        addr = symbols.address_of(name)
        if not _in_code(addr, code):
            return f"{name} is not in code"
    wrong = [name for name, addr in exports or () if not symbols.has(name, addr)]
    if exports and wrong:
        return (
            f"{len(wrong)} of {len(exports)} exported symbols are not where __ksymtab puts "
            f"them (first: {wrong[0]})"
        )
    return None


def _in_code(addr: int | None, code: list[tuple[int, int]]) -> bool:
    return addr is not None and any(lo <= addr < hi for lo, hi in code)
