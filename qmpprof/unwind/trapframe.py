"""Crossing a trap frame that no CFI describes (``elf/trapframe.py`` reads its layout from the
kernel's DWARF): at the return address of a call to the trap handler, the caller's stack holds
the frame's address, and the frame the interrupted registers. The interrupted pc is exact."""

from __future__ import annotations

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.trapframe import TrapFrameLayout
from qmpprof.model import StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.steps import EXACT, Outcome, Regs, Via, word_reader


class TrapFrameStep:
    """Applies only at a return address right after a direct call to the layout's handler."""

    via = Via.ENTRY
    __slots__ = ("arch", "bias", "code", "code_addr", "layout")

    def __init__(
        self, layout: TrapFrameLayout, code: bytes, code_addr: int, bias: int, arch: InstructionSet
    ) -> None:
        self.layout = layout
        self.code = code
        self.code_addr = code_addr  # link address of code[0]
        self.bias = bias
        self.arch = arch

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        if interrupted:
            return None  # a trap frame is found from a return address, never at a leaf
        arch, layout = self.arch, self.layout
        ra = pc + 1 - self.bias
        end = ra - self.code_addr
        if not 5 <= end <= len(self.code):
            return None
        if arch.call_before(self.code[end - 5 : end], ra) != layout.handler:
            return None
        mask, read = arch.mask, word_reader(memory, arch)
        frame = read((cur[arch.sp] + layout.argument) & mask)
        if frame is None:
            return StopReason.READ_FAILED
        new_pc, fp = read((frame + layout.pc) & mask), read((frame + layout.fp) & mask)
        sp_slot = (frame + layout.sp) & mask
        in_kernel = new_pc is not None and 0 <= new_pc - self.bias - self.code_addr < len(self.code)
        sp = sp_slot if in_kernel and not arch.same_level_trap_saves_sp else read(sp_slot)
        if new_pc is None or fp is None or sp is None:
            return StopReason.READ_FAILED
        new = dict(cur)
        new[arch.pc], new[arch.sp], new[arch.fp] = new_pc, sp, fp
        return new, EXACT
