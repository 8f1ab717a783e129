"""The instruction sets qmpprof reads, one module each behind ``base.InstructionSet``, and the
register formats of QEMU's targets behind ``base.RegisterFormats``: this is their registry.
A new instruction set is a module of this package and a ``register`` line below."""

from __future__ import annotations

from qmpprof.arch import x86, x86regs
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
]

_BY_NAME: dict[str, InstructionSet] = {}
# QEMU's target (query-target's arch, or a gdbstub's <architecture>) -> its register formats
_FORMATS: dict[str, RegisterFormats] = {}


def register(
    isa: InstructionSet, formats: RegisterFormats | None = None, targets: tuple[str, ...] = ()
) -> None:
    """Make ``isa`` known by its name and its ELF machine; ``formats`` read the registers of
    QEMU's ``targets`` (as ``query-target`` or a gdbstub's target description names them)."""
    _BY_NAME[isa.name] = isa
    if formats is not None:
        _FORMATS.update(dict.fromkeys(targets, formats))


def by_name(name: str) -> InstructionSet:
    """The instruction set ``Registers.isa`` names. KeyError for one never registered."""
    return _BY_NAME[name]


def names() -> list[str]:
    """The registered instruction sets' names, in order."""
    return list(_BY_NAME)


def by_elf(machine: int, bits: int) -> InstructionSet | None:
    """The instruction set of an ELF's ``e_machine`` and class, None when none is known."""
    for isa in _BY_NAME.values():
        if isa.elf_machine == (machine, bits):
            return isa
    return None


def default() -> InstructionSet:
    """The instruction set of a run that has no kernel file to tell: the first registered."""
    return next(iter(_BY_NAME.values()))


def formats(target: str) -> RegisterFormats | None:
    """How QEMU's ``target`` prints registers, None for a target no module reads."""
    return _FORMATS.get(target)


_X86 = x86regs.X86Formats()
register(x86.X86_64, _X86, ("x86_64", "i386:x86-64"))
register(x86.I386, _X86, ("i386",))
