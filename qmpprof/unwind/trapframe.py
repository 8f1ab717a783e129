"""Crossing a trap frame that no CFI describes (``elf/trapframe.py`` reads its layout from the
kernel's DWARF): at the return address of a call to the trap handler, the caller's stack holds
the frame's address, and the frame the interrupted registers (each one it has a member for is
taken from it). A handler taking the address in a register (x86_64: rdi) was given it by the
instruction right before the call, which set it from the stack pointer (``mov rdi, rsp``; ``lea
rdi, [rsp + n]``): the frame is there, above the stack pointer at the return. The interrupted
pc is exact.

A frame still being built (the CPU stopped in the entry code, between the vector it entered by
and the handler's call) is read from the code: the pushes still to come before that call
(``InstructionSet.path_to_call``) say where the handler's argument will lie (or the stack
address its register will hold) and so where the frame starts, whose pc member is the slot the
CPU pushed the interrupted pc to. The frame's frame-pointer member is read where it is already
pushed, else taken from the register the code will push there. Where the code does not tell
(the argument pushed from no stack address, the frame's pc slot below the stack pointer), the
walk stops rather than read a frame not there.
"""

from __future__ import annotations

from qmpprof.arch.base import InstructionSet, PathToCall, ReadWord
from qmpprof.elf.trapframe import TrapFrameLayout
from qmpprof.memo import Memo
from qmpprof.model import StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.steps import EXACT, Outcome, Regs, Via, word_reader

_CACHE_LIMIT = 1 << 14


class TrapFrameStep:
    """Applies at a return address right after a direct call to the layout's handler, and at
    an interrupted pc whose code goes straight on to that call (a frame still being built)."""

    via = Via.ENTRY
    __slots__ = ("_held", "_paths", "arch", "bias", "code", "code_addr", "layout")

    def __init__(
        self, layout: TrapFrameLayout, code: bytes, code_addr: int, bias: int, arch: InstructionSet
    ) -> None:
        self.layout = layout
        self.code = code
        self.code_addr = code_addr  # link address of code[0]
        self.bias = bias
        self.arch = arch
        self._paths: Memo[int, PathToCall | None] = Memo(_CACHE_LIMIT)  # link pc -> its way
        self._held: Memo[int, int | None] = Memo(_CACHE_LIMIT)  # link call -> frame offset

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        if interrupted:
            return self._partial(cur, pc - self.bias, memory)
        arch, layout = self.arch, self.layout
        ra = pc + 1 - self.bias
        end = ra - self.code_addr
        if not 5 <= end <= len(self.code):
            return None
        if arch.call_before(self.code[end - 5 : end], ra) != layout.handler:
            return None
        mask, read = arch.mask, word_reader(memory, arch)
        if layout.register is None:
            frame = read((cur[arch.sp] + layout.argument) & mask)
            if frame is None:
                return StopReason.READ_FAILED
        else:
            held = self._held_at(ra - 5, layout.register)
            if held is None:
                return None
            frame = (cur[arch.sp] + held) & mask
        new_pc, fp = read((frame + layout.pc) & mask), read((frame + layout.fp) & mask)
        sp_slot = (frame + layout.sp) & mask
        in_kernel = new_pc is not None and 0 <= new_pc - self.bias - self.code_addr < len(self.code)
        sp = sp_slot if in_kernel and not arch.same_level_trap_saves_sp else read(sp_slot)
        if new_pc is None or fp is None or sp is None:
            return StopReason.READ_FAILED
        new = dict(cur)
        new[arch.pc], new[arch.sp], new[arch.fp] = new_pc, sp, fp
        for reg, offset in layout.registers:  # the rest as the frame kept them, else unknown
            value = read((frame + offset) & mask)
            if value is None:
                new.pop(reg, None)
            else:
                new[reg] = value
        return new, EXACT

    def _partial(self, cur: Regs, link_pc: int, memory: PageCache) -> Outcome:
        """The interrupted code's registers when the CPU stopped at ``link_pc`` on the way to
        the handler's call; None when the code there does not go straight to it."""
        try:
            path = self._paths[link_pc]
        except KeyError:
            path = self._paths.put(
                link_pc,
                self.arch.path_to_call(self.code, self.code_addr, link_pc, self.layout.handler),
            )
        if path is None:
            return None
        arch, layout = self.arch, self.layout
        mask, read, sp = arch.mask, word_reader(memory, arch), cur[arch.sp]
        frame = self._frame(path, cur, read)  # from the stack pointer
        if isinstance(frame, StopReason):
            return frame
        if frame + layout.pc < 0:
            return StopReason.NO_CFI  # the CPU's part would lie below the stack: not this code
        slot = (sp + frame + layout.pc) & mask
        if read(slot) is None:
            return StopReason.READ_FAILED
        interrupted = arch.trap_return(slot, read)
        if interrupted is None:
            return StopReason.NO_CFI  # no frame the CPU pushed there
        fp = self._frame_pointer(path, frame + layout.fp, cur, read)
        if isinstance(fp, StopReason):
            return fp
        new = dict(cur)
        new[arch.pc], new[arch.sp] = interrupted
        new[arch.fp] = fp
        return new, EXACT

    def _held_at(self, call: int, register: int) -> int | None:
        """The stack address ``register`` holds at the call at link address ``call`` (its
        offset from the stack pointer there), as the one instruction right before the call set
        it; None: no such instruction."""
        try:
            return self._held[call]
        except KeyError:
            pass
        found = None
        for size in range(2, 9):  # x86's mov rdi, rsp: 3 bytes; lea with a disp32: 8
            path = self.arch.path_to_call(
                self.code, self.code_addr, call - size, self.layout.handler
            )
            if path is not None and path.depth == 0:
                found = dict(path.held).get(register)
                if found is not None:
                    break
        return self._held.put(call, found)

    def _frame(self, path: PathToCall, cur: Regs, read: ReadWord) -> int | StopReason:
        """The frame's address less the stack pointer: the stack address the handler's
        register will hold (set on the way, or already), the handler's argument pushed on the
        way as a stack address, or already on the stack."""
        arch, register, sp = self.arch, self.layout.register, cur[self.arch.sp]
        if register is not None:
            held = dict(path.held).get(register)
            if held is None and register not in path.written and register in cur:
                held = _signed((cur[register] - sp) & arch.mask, arch.mask)
            return StopReason.NO_CFI if held is None or held < -path.depth else held
        argument = self.layout.argument - path.depth
        address = dict(path.addresses).get(argument)
        if address is not None:
            return address
        if argument < 0:
            return StopReason.NO_CFI  # the argument is no stack address the code pushes
        frame = read((sp + argument) & arch.mask)
        if frame is None:
            return StopReason.READ_FAILED
        return _signed((frame - sp) & arch.mask, arch.mask)

    def _frame_pointer(
        self, path: PathToCall, at: int, cur: Regs, read: ReadWord
    ) -> int | StopReason:
        """The frame's frame-pointer member, ``at`` from the stack pointer: on the stack once
        pushed, else the register the code will push there."""
        if at >= 0:
            fp = read((cur[self.arch.sp] + at) & self.arch.mask)
            return StopReason.READ_FAILED if fp is None else fp
        reg = dict(path.saved).get(at)
        fp = None if reg is None else cur.get(reg)
        return StopReason.NO_CFI if fp is None else fp  # pushed from nothing the walk knows


def _signed(offset: int, mask: int) -> int:
    return offset - (mask + 1) if offset > mask >> 1 else offset
