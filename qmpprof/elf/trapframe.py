"""The trap frame a kernel's entry code builds, read from the kernel's DWARF.

A kernel without CFI for its entry code (a teaching kernel's ``alltraps``, say) pushes the
interrupted registers into a struct and calls its handler with a pointer to it. The handler is
the function whose one parameter points to a struct with members named like the instruction
set's pc, stack pointer and frame pointer (``eip``, ``esp``, ``ebp``); where the pointer lies
at the handler's entry is the parameter's location there, an offset from the handler's CFA
(``DW_OP_fbreg`` under a ``DW_OP_call_frame_cfa`` frame base: a stack argument). A handler
taking the pointer in a register leaves DWARF unable to tell where it was once the handler has
returned: no layout then. Only the units whose bytes name all three members are parsed
(``dwarfunits``): a kernel with none, a Linux vmlinux, is passed over in seconds, not minutes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qmpprof.elf.dwarfunits import Unit, units_naming

if TYPE_CHECKING:
    from qmpprof.elf.image import ElfImage

_DW_OP_FBREG, _DW_OP_CALL_FRAME_CFA = 0x91, 0x9C
_SEARCHED = (".debug_info", ".debug_str", ".debug_abbrev")
_SKIPPED_TYPES = ("DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type")


@dataclass(frozen=True, slots=True)
class TrapFrameLayout:
    """``handler``: the handler's link address; its caller's stack pointer at the return
    (the handler's CFA) plus ``argument`` holds the trap frame's address; ``pc``, ``sp``,
    ``fp``: the byte offsets of those registers' members in the frame."""

    handler: int
    argument: int
    pc: int
    sp: int
    fp: int


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
            layout = _layout(image, die, wanted)
            if layout is not None:
                return layout
    return None


def _functions(top: Any) -> Iterator[Any]:
    for die in top.iter_children():
        if die.tag == "DW_TAG_subprogram" and "DW_AT_low_pc" in die.attributes:
            yield die


def _layout(image: ElfImage, die: Any, wanted: tuple[str, str, str]) -> TrapFrameLayout | None:
    params = [c for c in die.iter_children() if c.tag == "DW_TAG_formal_parameter"]
    if len(params) != 1 or "DW_AT_type" not in params[0].attributes:
        return None
    members = _pointee_members(params[0].get_DIE_from_attribute("DW_AT_type"))
    if members is None or not all(name in members for name in wanted):
        return None
    base = die.attributes.get("DW_AT_frame_base")
    if base is None or bytes(base.value) != bytes([_DW_OP_CALL_FRAME_CFA]):
        return None
    argument = _fbreg_at_entry(image, params[0])
    if argument is None:
        return None
    pc, sp, fp = (members[name] for name in wanted)
    return TrapFrameLayout(die.attributes["DW_AT_low_pc"].value, argument, pc, sp, fp)


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


def _fbreg_at_entry(image: ElfImage, param: Any) -> int | None:
    """The parameter's ``DW_OP_fbreg`` offset where it is first described (a location list's
    first entry: the handler's entry), None for any other location."""
    attr = param.attributes.get("DW_AT_location")
    exprs = [] if attr is None else image.location_exprs(param, attr)
    if not exprs or len(exprs[0]) < 2 or exprs[0][0] != _DW_OP_FBREG:
        return None
    return _sleb(exprs[0][1:])


def _sleb(data: bytes) -> int | None:
    value = shift = 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value - (1 << shift) if byte & 0x40 else value
    return None
