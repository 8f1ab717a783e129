"""The machine's firmware (BIOS, option ROMs, the loaders they run) told from the guest's own
code, for every sample of the generic guest OSes, by what the CPU says and where its pc is.

A vCPU runs the firmware when it does not translate addresses (x86: CR0.PG clear; real mode,
CR0.PE clear, implies it, and SeaBIOS's 32-bit code runs flat without paging) at a pc that none
of the run's ELF files holds: not the kernel's link addresses, nor its physical load addresses
(``p_paddr``: a kernel runs its first instructions there before it turns paging on, and those
are the kernel's, not the firmware's). Without ``--kernel`` every untranslated pc is the
firmware's. Where the registers do not say whether the vCPU translates (aarch64 here), nothing
is taken for firmware. Such a sample is one frame of ``model.FIRMWARE``, named ``[firmware]``:
its stack is not walked (no ELF describes it, and much of it is 16-bit code).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.image import ElfImage
from qmpprof.guest.base import Identity
from qmpprof.model import FIRMWARE, Registers, StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.space import AddressSpace, Module
from qmpprof.unwind.steps import Regs, Via


class _End:
    """The one unwinding step of the firmware: the walk ends at the pc."""

    via = Via.REGS

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> StopReason:
        return StopReason.END


FIRMWARE_SPACE = AddressSpace([Module(FIRMWARE, steps=(_End(),))])


class Firmware:
    """Tells firmware samples apart from the run's code (``known``: the ranges of its ELF
    files, link and physical addresses) and gives them their identity."""

    def __init__(self, known: Sequence[tuple[int, int]], arch: InstructionSet) -> None:
        self.known = tuple(known)
        self.arch = arch

    @classmethod
    def of(cls, kernel: ElfImage | None, arch: InstructionSet) -> Firmware:
        if kernel is None:
            return cls((), arch)
        return cls((kernel.load_range, *kernel.physical_ranges), arch)

    def runs(self, regs: Registers) -> bool:
        """Whether the vCPU of ``regs`` runs the firmware."""
        if regs.special.get("paging", 1):
            return False
        return not any(low <= regs.pc < high for low, high in self.known)

    def identity(self, regs: Registers) -> Identity:
        """A firmware sample's identity: no process, the firmware's space; its registers in the
        walker's instruction set (the vCPU's mode is often another), so that the walk takes the
        firmware's one step and ends whole at the pc."""
        walked = dataclasses.replace(regs, isa=self.arch.name)
        return Identity(None, FIRMWARE_SPACE, registers=walked)
