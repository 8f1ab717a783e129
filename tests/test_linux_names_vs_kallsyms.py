"""qmpprof's names of kernel frames under KASLR against the guest's own /proc/kallsyms.

The Linux test guest boots with KASLR on and sends its /proc/kallsyms (runtime addresses, the
module's symbols included); qmpprof profiles it for ~2 s over QMP (``--kernel`` the vmlinuz,
no symbols but the image's own kallsyms, the slide found over QMP, the module read from guest
memory). Every kernel frame of every sample is named by the guest's table: the
greatest text symbol at or below the address (the leaf's RIP; for callers, the call
instruction before the return address, as qmpprof looks them up), any alias at that address.
Issue 11 asks for >= 99 % of frames equal.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import Counter
from pathlib import Path

import pytest
from linuxvm import MODULE, ROOT, LinuxGuest, running_linux_guest

from qmpprof import session
from qmpprof.linux.symbols import TEXT_TYPES, KernelSymbols
from qmpprof.profile import Profile
from qmpprof.sampler import SamplerConfig

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

VMLINUZ = ROOT / "fixtures" / "build" / "linux" / "vmlinuz"
REQUIRED = 0.99
IMAGE_TEXT = 0xFFFFFFFF81000000  # _text in Debian's vmlinux
# On a loaded host TCG can fail the kernel's IO-APIC timer check (a panic at boot: "IO-APIC +
# timer doesn't work"): skip the check.
NO_TIMER_CHECK = "no_timer_check"


class GuestNames:
    """The guest's text symbols: address -> every name a text symbol has there."""

    def __init__(self, symbols: KernelSymbols) -> None:
        names: dict[int, list[str]] = {}
        for addr, kind, name in zip(symbols.addrs, symbols.types, symbols.names, strict=True):
            if kind in TEXT_TYPES:
                names.setdefault(addr, []).append(name)
        self.addrs = sorted(names)
        self.names = [names[a] for a in self.addrs]

    def at(self, addr: int) -> list[str]:
        i = bisect.bisect_right(self.addrs, addr) - 1
        return self.names[i] if i >= 0 else []


async def profile_guest(guest: LinuxGuest) -> Profile:
    spec = session.RunSpec(
        qmp_socket=guest.qmp_socket,
        transport="qmp",
        kernel=VMLINUZ,
        os="linux",
        sampling=SamplerConfig(interval=0.01, duration=2.0),
    )
    run = await session.start(spec)
    try:
        await run.run()
    finally:
        await run.transport.close()
    return run.profile


def kernel_names(
    profile: Profile, table: GuestNames
) -> tuple[int, int, Counter[str], Counter[str]]:
    """(equal, total, wrong, names) over every kernel frame of every sample, weighted by count.
    A caller's return address may be the first byte of the next function (a call to a
    noreturn function ends its caller): the call is at pc - 1. A frame interrupted by an entry
    (pt_regs) has an exact pc, so either is the guest's name."""
    equal = total = 0
    wrong: Counter[str] = Counter()
    names: Counter[str] = Counter()
    for record, count in zip(profile.stacks, profile.counts, strict=True):
        for depth, fid in enumerate(record.frames):
            frame = profile.frames[fid]
            if not frame.kernel:
                continue
            want = table.at(frame.pc) if depth == 0 else table.at(frame.pc - 1)
            if depth and frame.symbol not in want:
                want = want + table.at(frame.pc)
            total += count
            names[frame.symbol or "?"] += count
            if frame.symbol in want:
                equal += count
            else:
                wrong[f"{frame.pc:#x}: qmpprof {frame.symbol} kallsyms {want}"] += count
    return equal, total, wrong, names


def test_kernel_frame_names_match_the_guests_kallsyms_under_kaslr(tmp_path: Path) -> None:
    if not VMLINUZ.is_file():
        pytest.fail(f"{VMLINUZ} is missing: run scripts/fetch-linux (scripts/setup does)")
    with running_linux_guest(tmp_path, kaslr=True, smp=2, append=NO_TIMER_CHECK) as guest:
        assert guest.text_address != IMAGE_TEXT, "KASLR did not move the kernel"
        profile = asyncio.run(profile_guest(guest))
        table = GuestNames(guest.symbols)
    equal, total, wrong, names = kernel_names(profile, table)
    share = equal / max(total, 1)
    print(
        f"\nslide {guest.text_address - IMAGE_TEXT:#x}: {equal}/{total} kernel frames ({share:.2%})"
    )
    print("most frequent:", names.most_common(12))
    print("\n".join(f"{n:5d}  {what}" for what, n in wrong.most_common()))
    assert sum(profile.counts) >= 200
    # The module's frames must be among them: its symbols come from guest memory.
    assert "qb_burn_leaf" in names and "qb_kwork_leaf" in names, names.most_common(30)
    assert guest.symbols.address_of("qb_burn_leaf", MODULE) is not None
    assert share >= REQUIRED, wrong.most_common(20)
