"""Whether the kernel file of a run is the kernel the guest runs, for the guest OSes with no
check of their own (Linux matches its KASLR slide against the guest, ``linux/slide.py``): the
file's code bytes at a few places against the guest's, before a sample of it is kept.

The places: where vCPUs run in the file's code, and ``SPREAD`` more spread evenly over it
(its executable sections, at their link addresses: a kernel linked low or identity-mapped is
read where it is linked, never at a default). ``PLACE`` bytes are compared at each. A kernel
may patch a few instructions at boot, so one place differing says nothing (and an instruction
set's equivalent forms of an instruction are the same: ``same_code``): the file is the
running kernel when at least ``AGREE`` of the places that read are the same, and it is not
when fewer are. Fewer than ``MIN_PLACES`` that read decide nothing yet.

When: only once a kernel runs, else the guest's memory may not hold it yet (a guest started
paused at the reset vector, whose firmware loads the kernel later): a vCPU whose pc is in the
file's code, or one with paging on in user mode (a kernel started it), or in kernel mode at a
pc in the kernel's half of the address space (a kernel linked elsewhere than the file: then
none of the places reading is a mismatch too; in user mode it decides nothing, a kernel may
unmap itself there). A kernel's first instructions run where its code is loaded (p_paddr),
paging off or identity-mapped, before it jumps to its link addresses: a pc in the file's
code there shows the kernel too, and the places are read at their load addresses then.
``attach`` looks at the vCPUs while the guest runs, for up to ``WAIT`` seconds; when none
showed a kernel meanwhile (the guest paused before its kernel loaded), the first sample that
does checks, in its pause, before it is kept: a mismatch then ends the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelMismatchError
from qmpprof.memory import Reader, reader
from qmpprof.model import Registers
from qmpprof.transport.base import GuestTransport

PLACE = 16  # bytes compared at each place
SPREAD = 8  # places spread over the file's code, beside those where vCPUs run
AGREE = 0.75  # the share of places that must be the same
MIN_PLACES = 3
WAIT = 1.0  # seconds attach looks for a vCPU in kernel code while the guest runs
_LOOK = 0.02  # seconds between two looks then


class KernelCheck:
    """The check of one kernel file; ``done`` once it passed (a mismatch raises)."""

    def __init__(self, image: ElfImage, arch: InstructionSet) -> None:
        self.image = image
        self.arch = arch
        self.code = [(lo, hi) for lo, hi in image.code_ranges() if hi - lo >= PLACE]
        # The code's load addresses where they are not its link addresses: (start, end, link).
        self.loaded = [
            (at, at + hi - lo, lo)
            for lo, hi in self.code
            if (at := image.physical(lo)) is not None and at != lo
        ]
        self.done = not self.code  # a file with no code has nothing to compare

    def runs_kernel(self, regs: Registers) -> bool:
        """Whether ``regs`` show a kernel running (the moment the check can be made)."""
        if self._holds(regs.pc) or self._linked(regs.pc) is not None:
            return True
        paging = regs.special.get("paging", 1)
        return bool(paging) and (regs.user or regs.pc >= self.arch.kernel_boundary)

    def places(self, pcs: Sequence[int]) -> list[int]:
        """The addresses compared: those of ``pcs`` in the file's code, then SPREAD more."""
        found = [min(pc, hi - PLACE) for pc in pcs for lo, hi in self.code if lo <= pc < hi]
        total = sum(hi - lo for lo, hi in self.code)
        for i in range(SPREAD):
            at = (2 * i + 1) * total // (2 * SPREAD)
            for lo, hi in self.code:
                if at < hi - lo:
                    found.append(min(lo + at - at % PLACE, hi - PLACE))
                    break
                at -= hi - lo
        return sorted(set(found))

    async def check(self, read: Reader, regs: Registers) -> bool:
        """Compare the places with the guest's memory as ``read`` sees it while the vCPU of
        ``regs`` shows a kernel; True once decided (the file is the guest's kernel), False when
        too few places read. Raises KernelMismatchError when it is not: too few of the places
        the same, or none read while the kernel runs at a pc outside the file's code."""
        pc = regs.pc
        early = self._linked(pc)  # the kernel runs where it is loaded: its code is read there
        places = self.places([pc if early is None else early])
        where = places if early is None else [self._load_address(at) for at in places]
        running = await read([(at, PLACE) for at in where])
        compared = [
            (at, self._same(at, data))
            for at, data in zip(places, running, strict=True)
            if data is not None
        ]
        if not compared and not regs.user and not self._holds(pc) and early is None:
            raise KernelMismatchError(
                f"the guest runs kernel code at {pc:#x}, and none of {self.image.path}'s code"
                " reads in the guest: give the kernel file the guest booted"
            )
        if len(compared) < min(MIN_PLACES, len(places)):
            return False
        same = sum(1 for _, equal in compared if equal)
        if same < AGREE * len(compared):
            first = next(at for at, equal in compared if not equal)
            raise KernelMismatchError(
                f"{self.image.path}'s code differs from the guest's at"
                f" {len(compared) - same} of {len(compared)} places (the first at {first:#x}):"
                " give the kernel file the guest booted"
            )
        self.done = True
        return True

    def _same(self, at: int, running: bytes) -> bool:
        file = self.image.code_at(at, PLACE)
        return file is not None and self.arch.same_code(file, running)

    def _holds(self, pc: int) -> bool:
        return any(lo <= pc < hi for lo, hi in self.code)

    def _load_address(self, at: int) -> int:
        """Where link address ``at`` of the file's code is loaded (itself where no segment
        says otherwise)."""
        found = self.image.physical(at)
        return at if found is None else found

    def _linked(self, pc: int) -> int | None:
        """The link address of a ``pc`` in the file's code at its load address, else None."""
        for lo, hi, link in self.loaded:
            if lo <= pc < hi:
                return pc - lo + link
        return None

    async def attach(self, control: GuestTransport) -> None:
        """Check while the guest runs, through ``control``, when a vCPU shows a kernel within
        WAIT seconds (one look when the guest is paused: nothing will change)."""
        deadline = time.monotonic() + WAIT
        running = await control.is_running()
        while not self.done:
            for cpu in await control.cpus():
                regs = await control.registers(cpu)
                if self.runs_kernel(regs) and await self.check(reader(control, cpu), regs):
                    return
            if not running or time.monotonic() > deadline:
                return
            await asyncio.sleep(_LOOK)

    async def in_pause(self, transport: GuestTransport, regs: Registers) -> None:
        """In a sample's pause, before it is kept: check when it shows a kernel."""
        if not self.done and self.runs_kernel(regs):
            await self.check(reader(transport, regs.cpu), regs)
