"""Frames for one pc of a walked stack: module, symbol + offset, and (with lines) source
positions with the functions inlined at that pc expanded into frames of their own."""

from __future__ import annotations

from qmpprof.model import Frame
from qmpprof.unwind.space import AddressSpace


def frames_at(
    pc: int, exact: bool, space: AddressSpace, kernel_boundary: int, lines: bool
) -> tuple[Frame, ...]:
    """The frames at ``pc``, innermost first. A caller's pc is a return address: it is looked
    up at pc - 1 so that a call ending a function is not charged to the next one."""
    lookup = pc if exact else pc - 1
    module = space.find(lookup)
    if module is None:
        return (Frame(pc, pc >= kernel_boundary),)
    mapping, kernel = module.mapping, module.kernel
    link = lookup - module.bias
    hit = None if module.symbols is None else module.symbols.lookup(link)
    if hit is None:
        return (Frame(pc, kernel, module=mapping),)
    name, offset = hit
    offset += pc - lookup
    sources = module.lines.frames(link) if lines and module.lines is not None else ()
    if not sources:
        return (Frame(pc, kernel, name, offset, mapping),)
    inlined = tuple(
        Frame(pc, kernel, src.function or "[inlined]", 0, mapping, src.file, src.line, inlined=True)
        for src in sources[:-1]
    )
    outer = sources[-1]
    return (*inlined, Frame(pc, kernel, name, offset, mapping, outer.file, outer.line))
