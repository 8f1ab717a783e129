"""The trap frame a kernel's entry code builds, read from the kernel's DWARF.

A kernel without CFI for its entry code (a teaching kernel's ``alltraps``, say) pushes the
interrupted registers into a struct and calls its handler with a pointer to it. The handler is
the function whose one parameter points to a struct with members named like the instruction
set's pc, stack pointer and frame pointer (``eip``, ``esp``, ``ebp``); where the pointer lies
at the handler's entry is the parameter's location there: an offset from the handler's CFA
(``DW_OP_fbreg`` under a ``DW_OP_call_frame_cfa`` frame base: a stack argument, i386's), or a
register (``DW_OP_reg5``: x86_64's rdi). DWARF cannot tell what a register held once the
handler has returned: the entry code's own instructions do (``mov rdi, rsp`` right before the
call: ``unwind/trapframe.py``). Only the units whose bytes name all three members are parsed
(``dwarfunits``): a kernel with none, a Linux vmlinux, is passed over in seconds, not minutes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qmpprof.dwarf.encoding import CfiDecodeError, Reader
from qmpprof.elf.dwarfunits import Unit, units_naming

if TYPE_CHECKING:
    from qmpprof.elf.image import ElfImage

_DW_OP_FBREG, _DW_OP_CALL_FRAME_CFA = 0x91, 0x9C
_DW_OP_REG0, _DW_OP_REG31, _DW_OP_REGX = 0x50, 0x6F, 0x90
_SEARCHED = (".debug_info", ".debug_str", ".debug_abbrev")
_SKIPPED_TYPES = ("DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type")


@dataclass(frozen=True, slots=True)
class TrapFrameLayout:
    """``handler``: the handler's link address; its caller's stack pointer at the return
    (the handler's CFA) plus ``argument`` holds the trap frame's address, or (``register``:
    its DWARF number) the handler takes the address in that register; ``pc``, ``sp``, ``fp``:
    the byte offsets of those registers' members in the frame; ``registers``: the other
    registers it keeps (DWARF number, offset)."""

    handler: int
    argument: int
    pc: int
    sp: int
    fp: int
    register: int | None = None
    registers: tuple[tuple[int, int], ...] = ()


def trap_frame_layout(image: ElfImage) -> TrapFrameLayout | None:
    """The layout of ``image``'s trap frame, None when its DWARF shows none (see above)."""
    dwarf = image.dwarf_info()
    if dwarf is None:
        return None
    arch = image.arch
    wanted = (arch.names[arch.pc], arch.names[arch.sp], arch.names[arch.fp])
    cus = list(dwarf.iter_CUs())
    units = [
        Unit(cu.cu_offset, cu.cu_offset + cu.size, cu["debug_abbrev_offset"],
             cu.structs.dwarf_format == 64)
        for cu in cus
    ]  # fmt: skip
    info, strings, abbrev = (image.section(name) or b"" for name in _SEARCHED)
    naming = units_naming(units, info, strings, abbrev, wanted)
    for cu in cus:
        if cu.cu_offset not in naming:
            continue
        for die in _functions(cu.get_top_DIE()):
            layout = _layout(image, die, wanted, arch.names)
            if layout is not None:
                return layout
    return None


def _functions(top: Any) -> Iterator[Any]:
    """The functions defined under ``top``, in its namespaces too (rustc puts a crate's
    functions in the crate's namespace, C++ compilers theirs)."""
    for die in top.iter_children():
        if die.tag == "DW_TAG_subprogram" and "DW_AT_low_pc" in die.attributes:
            yield die
        elif die.tag == "DW_TAG_namespace":
            yield from _functions(die)


def _layout(
    image: ElfImage, die: Any, wanted: tuple[str, str, str], names: Sequence[str]
) -> TrapFrameLayout | None:
    params = [c for c in die.iter_children() if c.tag == "DW_TAG_formal_parameter"]
    if len(params) != 1 or "DW_AT_type" not in params[0].attributes:
        return None
    members = _pointee_members(params[0].get_DIE_from_attribute("DW_AT_type"))
    if members is None or not all(name in members for name in wanted):
        return None
    pc, sp, fp = (members[name] for name in wanted)
    # The other registers the frame keeps (rax .. r15, eax .. edi), by their DWARF numbers.
    kept = tuple(
        (number, members[name])
        for number, name in enumerate(names)
        if name in members and name not in wanted
    )
    handler = die.attributes["DW_AT_low_pc"].value
    attr = params[0].attributes.get("DW_AT_location")
    exprs = [] if attr is None else image.location_exprs(params[0], attr)
    first = exprs[0] if exprs else b""  # a location list's first entry: the handler's entry
    register = _register(first)
    if register is not None:
        return TrapFrameLayout(handler, 0, pc, sp, fp, register, kept)
    base = die.attributes.get("DW_AT_frame_base")
    if base is None or bytes(base.value) != bytes([_DW_OP_CALL_FRAME_CFA]):
        return None
    if len(first) < 2 or first[0] != _DW_OP_FBREG:
        return None
    argument = _sleb(first[1:])
    if argument is None:
        return None
    return TrapFrameLayout(handler, argument, pc, sp, fp, registers=kept)


def _pointee_members(die: Any) -> dict[str, int] | None:
    """Member name -> byte offset of the struct ``die`` (a pointer type) points to."""
    if die.tag != "DW_TAG_pointer_type" or "DW_AT_type" not in die.attributes:
        return None
    target = die.get_DIE_from_attribute("DW_AT_type")
    while target.tag in _SKIPPED_TYPES and "DW_AT_type" in target.attributes:
        target = target.get_DIE_from_attribute("DW_AT_type")
    if target.tag != "DW_TAG_structure_type":
        return None
    members: dict[str, int] = {}
    for member in target.iter_children():
        where = member.attributes.get("DW_AT_data_member_location")
        name = member.attributes.get("DW_AT_name")
        # A constant offset; an expression would need evaluating, which no C struct needs.
        if member.tag == "DW_TAG_member" and name and where and isinstance(where.value, int):
            members[name.value.decode()] = where.value
    return members


def _register(expr: bytes) -> int | None:
    """The register a location expression names alone (``DW_OP_reg<n>``, ``DW_OP_regx n``)."""
    if len(expr) == 1 and _DW_OP_REG0 <= expr[0] <= _DW_OP_REG31:
        return expr[0] - _DW_OP_REG0
    if len(expr) >= 2 and expr[0] == _DW_OP_REGX:
        return _uleb(expr[1:])
    return None


def _uleb(data: bytes) -> int | None:
    try:
        return Reader(data).uleb()
    except CfiDecodeError:  # runs past its end
        return None


def _sleb(data: bytes) -> int | None:
    try:
        return Reader(data).sleb()
    except CfiDecodeError:
        return None
