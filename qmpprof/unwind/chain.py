"""The stack walker: registers + stack memory + known code -> the chain of return addresses.

For each frame it asks the unwinding steps of the module holding the pc (``steps.py``: CFI,
prologue analysis, frame pointers; a pc in no module gets frame pointers) in order, then checks
the answer against the sanity rules below. It reads memory only through ``PageCache`` and lets
``PageMissing`` propagate, so the sampler can fetch the page while the guest is stopped and
simply call ``unwind`` again: the walk is pure. Every way a walk can end is a ``StopReason``;
nothing here raises for bad stacks. Synchronous on purpose: no asyncio, no transport.

An Unwinder walks one instruction set, the kernel's (``arch``): an i386 walker takes the 32-bit
registers of a guest outside long mode, renumbers them to i386 DWARF numbers and reads 4-byte
stack words; an x86_64 walker gives such a guest's stack its one exact frame.
"""

from __future__ import annotations

from dataclasses import dataclass

from qmpprof.dwarf.arch import I386, X86_64, Arch
from qmpprof.model import KERNEL_BOUNDARY, RBP, RIP, RSP, Frame, Registers, Stack, StopReason
from qmpprof.pages import PageCache
from qmpprof.unwind.resolve import frames_at
from qmpprof.unwind.space import AddressSpace, Module
from qmpprof.unwind.steps import (
    EXACT,
    MASK64,
    NEW_STACK,
    Found,
    Regs,
    Via,
    frame_pointer_only,
    word_reader,
)

__all__ = ["AddressSpace", "Module", "RawStack", "Unwinder", "Via"]


@dataclass(frozen=True, slots=True)
class RawStack:
    """Return addresses leaf first. ``exact[i]``: pcs[i] is where the CPU was (the leaf, or code
    interrupted by a trap/signal frame), not a return address. ``via[i]``: how frame i was found."""

    pcs: tuple[int, ...]
    stop: StopReason
    exact: tuple[bool, ...] = ()
    via: tuple[Via, ...] = ()


def _trap_frame_sp(after_rip: int, memory: PageCache) -> int | None:
    """The interrupted RSP of an x86-64 trap frame whose RIP slot ends at ``after_rip`` (an
    interrupt or exception taken in user mode pushes SS, RSP, RFLAGS, CS, RIP), or None when
    what follows the RIP is not a user-mode CS and RFLAGS (bit 1 always set)."""
    cs = memory.read_u64(after_rip)
    flags = memory.read_u64((after_rip + 8) & MASK64)
    if cs is None or flags is None or cs & 3 != 3 or cs > 0xFFFF or not flags & 2:
        return None
    if flags >> 32:
        return None
    return memory.read_u64((after_rip + 16) & MASK64)


def _trap_frame_sp32(after_eip: int, memory: PageCache) -> int | None:
    """``_trap_frame_sp`` for i386: a trap from ring 3 pushes SS, ESP, EFLAGS, CS, EIP (4 bytes
    each), so the user ESP is two words above the CS that follows the EIP."""
    cs = memory.read_u32(after_eip)
    flags = memory.read_u32((after_eip + 4) & 0xFFFF_FFFF)
    if cs is None or flags is None or cs & 3 != 3 or cs > 0xFFFF or not flags & 2:
        return None
    return memory.read_u32((after_eip + 8) & 0xFFFF_FFFF)


TRAP_SCAN = 32  # words above a kernel's fake frame searched for the trap frame


def _canonical(pc: int) -> bool:
    return pc < 0x0000_8000_0000_0000 or pc >= 0xFFFF_8000_0000_0000


# The model's registers use x86_64 DWARF numbers, a 32-bit guest's zero-extended: each i386
# register's x86_64 number (eax rdx... -> eax ecx edx ebx esp ebp esi edi eip).
_I386_FROM_X86_64 = {0: 0, 2: 1, 1: 2, 3: 3, 7: 4, 6: 5, 4: 6, 5: 7, 16: 8}


def _registers32(regs: Registers) -> Regs:
    cur = {i386: regs.gprs[x64] & 0xFFFF_FFFF for x64, i386 in _I386_FROM_X86_64.items()
           if x64 in regs.gprs}  # fmt: skip
    cur[I386.pc], cur[I386.sp], cur[I386.fp] = regs.rip, regs.rsp, regs.rbp
    return cur


class Unwinder:
    """Walks stacks (``unwind``) and turns their addresses into frames (``resolve``)."""

    def __init__(
        self,
        *,
        kernel_boundary: int = KERNEL_BOUNDARY,
        max_depth: int = 128,
        lines: bool = False,
        arch: Arch = X86_64,
    ) -> None:
        self.kernel_boundary = kernel_boundary
        self.max_depth = max_depth
        self.lines = lines  # resolve's default: add file:line and inlined frames
        self.arch = arch

    def unwind(self, regs: Registers, memory: PageCache, space: AddressSpace) -> RawStack:
        """Walk the stack ``regs`` describe. Raises ``PageMissing`` for a page the cache has
        not fetched: fetch it and call again (the walk has no side effects)."""
        arch = self.arch
        if regs.long_mode == (arch is not X86_64):  # 8-byte slots on a 32-bit stack, or back
            return RawStack((regs.rip,), StopReason.NO_CFI, (True,), (Via.REGS,))
        if arch is X86_64:
            cur = dict(regs.gprs)
            cur[RIP], cur[RSP], cur[RBP] = regs.rip, regs.rsp, regs.rbp
        else:
            cur = _registers32(regs)
        pc_reg, sp_reg, fp_reg = arch.pc, arch.sp, arch.fp
        no_module = frame_pointer_only(arch)
        pc, exact, via = regs.rip, True, Via.REGS
        pcs: list[int] = []
        exacts: list[bool] = []
        vias: list[Via] = []
        seen: set[tuple[int, int]] = set()
        sp_guessed = False  # RSP is a stand-in, too rough for prologue analysis
        find = space.find
        boundary = self.kernel_boundary
        for _ in range(self.max_depth):
            pcs.append(pc)
            exacts.append(exact)
            vias.append(via)
            lookup = pc if exact else pc - 1
            module = find(lookup)
            outcome: Found | StopReason | None = None
            for step in no_module if module is None else module.steps:
                outcome = step.step(cur, lookup, exact and not sp_guessed, memory)
                if outcome is not None:
                    via = step.via
                    break
            if not isinstance(outcome, tuple):  # a stop, or no step had anything to say
                return RawStack(
                    tuple(pcs), outcome or StopReason.NO_CFI, tuple(exacts), tuple(vias)
                )
            new, flags = outcome
            signal = flags & EXACT != 0
            stop = self._check(cur, new, pc, flags & (EXACT | NEW_STACK) != 0, seen)
            if stop is not None:
                return RawStack(tuple(pcs), stop, tuple(exacts), tuple(vias))
            # A trap frame hands over to interrupted code: its pc is exact, not a return address.
            crossed = pc >= boundary > new[pc_reg]
            if crossed and via is Via.PROLOGUE and not signal:
                user_sp = self._trap_frame(new[sp_reg], memory)
                if user_sp is None:
                    # Kernel code "returning" to user code by a plain return address is no
                    # frame at all: a syscall entry before it saved anything (the user's pc
                    # is in RCX). Stop rather than make up a caller.
                    return RawStack(tuple(pcs), StopReason.NO_CFI, tuple(exacts), tuple(vias))
                new[sp_reg] = user_sp
            exact = signal or crossed
            sp_guessed = crossed and via is Via.FRAME_POINTER
            if sp_guessed:
                # A kernel's fake frame [rbp, interrupted rip] gives no user RSP; the trap frame
                # the CPU pushed lies a few words above it, holding that same rip.
                user_sp = self._trap_frame_above(new[sp_reg], new[pc_reg], memory)
                if user_sp is not None:
                    new[sp_reg], sp_guessed = user_sp, False
                elif new.get(fp_reg):
                    # The user RBP bounds it from above, all the next frame-pointer step needs.
                    new[sp_reg] = new[fp_reg]
            cur, pc = new, new[pc_reg]
        return RawStack(tuple(pcs), StopReason.DEPTH, tuple(exacts), tuple(vias))

    def _trap_frame_above(self, sp: int, pc: int, memory: PageCache) -> int | None:
        """The interrupted user stack pointer of the trap frame holding ``pc`` within
        TRAP_SCAN words from ``sp`` up (the entry code saves registers below the frame the CPU
        pushed), by ``_trap_frame_sp``'s checks of what follows the pc; None when none is."""
        word, mask = self.arch.address_size, self.arch.mask
        read = word_reader(memory, self.arch)
        for i in range(TRAP_SCAN):
            slot = (sp + i * word) & mask
            if read(slot) == pc:
                found = self._trap_frame((slot + word) & mask, memory)
                if found is not None:
                    return found
        return None

    def _trap_frame(self, after_pc: int, memory: PageCache) -> int | None:
        """The user stack pointer of the trap frame whose pc slot ends at ``after_pc``."""
        if self.arch is X86_64:
            return _trap_frame_sp(after_pc, memory)
        return _trap_frame_sp32(after_pc, memory)

    def _check(
        self, cur: Regs, new: Regs, pc: int, jumped: bool, seen: set[tuple[int, int]]
    ) -> StopReason | None:
        """Sanity rules between a frame and its caller. ``jumped``: the caller's stack pointer
        came from a trap frame or a saved stack pointer, not from the frame's by arithmetic:
        it may lie below (another stack), only an exact repeat is a loop."""
        arch = self.arch
        new_pc, new_sp = new.get(arch.pc), new[arch.sp]
        if not new_pc:
            return StopReason.END
        boundary = self.kernel_boundary
        valid = _canonical(new_pc) if arch is X86_64 else new_pc <= arch.mask
        if not valid or new_pc < 0x1000 or (pc < boundary <= new_pc):
            return StopReason.BAD_RETURN  # user code never returns into the kernel
        crossing = jumped or (pc >= boundary > new_pc)
        if new_sp <= cur[arch.sp] and not crossing:
            return StopReason.LOOP
        key = (new_pc, new_sp)
        if key in seen:
            return StopReason.LOOP
        seen.add(key)
        return None

    def resolve(self, raw: RawStack, space: AddressSpace, *, lines: bool | None = None) -> Stack:
        """The frames of a walked stack; callers are looked up at return address - 1 (the call
        instruction). With ``lines`` (default: the constructor's), frames get file:line and the
        functions inlined at a pc become frames of their own."""
        if lines is None:
            lines = self.lines
        cache = space.frames
        boundary = self.kernel_boundary
        exacts = raw.exact or (True,) + (False,) * (len(raw.pcs) - 1)
        frames: list[Frame] = []
        for pc, exact in zip(raw.pcs, exacts, strict=True):
            key = (pc, exact, boundary, lines)
            found = cache.get(key)
            if found is None:
                found = cache.put(key, frames_at(pc, exact, space, boundary, lines))
            frames += found
        return Stack(tuple(frames), raw.stop)
