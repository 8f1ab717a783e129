"""The instruction sets qmpprof reads, one module each behind ``base.InstructionSet``, and the
register formats of QEMU's targets behind ``base.RegisterFormats``: this is their registry.
A new instruction set is a module of this package and a ``register`` line below."""

from __future__ import annotations

import qmpprof.arch.aarch64 as aarch64
import qmpprof.arch.aarch64regs as aarch64regs
import qmpprof.arch.riscv64 as riscv64
import qmpprof.arch.riscv64regs as riscv64regs
import qmpprof.arch.x86 as x86
import qmpprof.arch.x86regs as x86regs
from qmpprof.arch.base import InstructionSet, PrologueRule, ReadWord, RegisterFormats

__all__ = [
    "InstructionSet",
    "PrologueRule",
    "ReadWord",
    "RegisterFormats",
    "by_elf",
    "by_name",
    "default",
    "formats",
    "names",
    "register",
    "unregister",
]

# Each in order of registration; a later one takes precedence where two claim the same ELF
# machine or QEMU target (a test's, say), until it is unregistered.
_ISAS: list[InstructionSet] = []
_FORMATS: list[tuple[str, RegisterFormats, InstructionSet]] = []  # (QEMU target, formats, isa)


def register(
    isa: InstructionSet, formats: RegisterFormats | None = None, targets: tuple[str, ...] = ()
) -> None:
    """Make ``isa`` known by its name and its ELF machine; ``formats`` read the registers of
    QEMU's ``targets`` (as ``query-target`` or a gdbstub's target description names them)."""
    _ISAS.append(isa)
    if formats is not None:
        _FORMATS.extend((target, formats, isa) for target in targets)


def unregister(isa: InstructionSet) -> None:
    """Forget ``isa`` and its register formats."""
    _ISAS[:] = [known for known in _ISAS if known is not isa]
    _FORMATS[:] = [entry for entry in _FORMATS if entry[2] is not isa]


def names() -> list[str]:
    """The registered instruction sets' names, in order."""
    return list(dict.fromkeys(isa.name for isa in _ISAS))


def by_name(name: str) -> InstructionSet:
    """The instruction set ``Registers.isa`` names. KeyError for one never registered."""
    for isa in reversed(_ISAS):
        if isa.name == name:
            return isa
    raise KeyError(name)


def by_elf(machine: int, bits: int) -> InstructionSet | None:
    """The instruction set of an ELF's ``e_machine`` and class, None when none is known."""
    for isa in reversed(_ISAS):
        if isa.elf_machine == (machine, bits):
            return isa
    return None


def default() -> InstructionSet:
    """The instruction set of a run that has no kernel file to tell: the first registered."""
    return _ISAS[0]


def formats(target: str) -> RegisterFormats | None:
    """How QEMU's ``target`` prints registers, None for a target no module reads."""
    for known, found, _ in reversed(_FORMATS):
        if known == target:
            return found
    return None


_X86 = x86regs.X86Formats()
register(x86.X86_64, _X86, ("x86_64", "i386:x86-64"))
register(x86.I386, _X86, ("i386",))
register(aarch64.AARCH64, aarch64regs.AArch64Formats(), ("aarch64",))
register(riscv64.RISCV64, riscv64regs.RiscV64Formats(), ("riscv64", "riscv:rv64"))
