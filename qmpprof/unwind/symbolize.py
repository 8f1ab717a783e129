"""Frames for one pc of a walked stack: module, symbol + offset, and (for --lines) source
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
    link = lookup - module.bias
    hit = None if module.symbols is None else module.symbols.lookup(link)
    if hit is None:
        return (Frame(pc, module.kernel, module=module.name),)
    name, offset = hit
    offset += pc - lookup
    if not lines or module.lines is None:
        return (Frame(pc, module.kernel, name, offset, module.name),)
    sources = module.lines.frames(link)
    if not sources:
        return (Frame(pc, module.kernel, name, offset, module.name),)
    inlined = tuple(
        Frame(pc, module.kernel, src.function or "[inlined]", 0, module.name, src.file, src.line,
              inlined=True)
        for src in sources[:-1]
    )  # fmt: skip
    outer = sources[-1]
    return (*inlined, Frame(pc, module.kernel, name, offset, module.name, outer.file, outer.line))
