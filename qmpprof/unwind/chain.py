"""The stack walker: registers + stack memory + known code -> the chain of return addresses.

For each frame it asks the unwinding steps of the module holding the pc (``steps.py``: CFI,
prologue analysis, frame pointers; a pc in no module gets frame pointers) in order, then checks
the answer against the sanity rules below. It reads memory only through ``PageCache`` and lets
``PageMissing`` propagate, so the sampler can fetch the page while the guest is stopped and
simply call ``unwind`` again: the walk is pure. Every way a walk can end is a ``StopReason``;
nothing here raises for bad stacks. Synchronous on purpose: no asyncio, no transport.

An Unwinder walks one instruction set, the kernel's (``arch``, a ``qmpprof.arch``
InstructionSet): registers in its DWARF numbers, stack words of its size. A vCPU that ran
another instruction set (a 32-bit process under a 64-bit kernel, say) gets its one exact frame.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qmpprof.arch.base import InstructionSet
from qmpprof.model import Frame, Registers, Stack, StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.resolve import frames_at
from qmpprof.unwind.space import AddressSpace, Module
from qmpprof.unwind.steps import (
    EXACT,
    LINK,
    NEW_STACK,
    Found,
    Regs,
    Via,
    frame_pointer_only,
    word_reader,
)
from qmpprof.unwind.tailcall import with_tail_calls

__all__ = ["AddressSpace", "Module", "RawStack", "Unwinder", "Via"]


@dataclass(frozen=True, slots=True)
class RawStack:
    """Return addresses leaf first. ``exact[i]``: pcs[i] is where the CPU was (the leaf, or code
    interrupted by a trap/signal frame), not a return address. ``via[i]``: how frame i was found.
    ``outer_kernel``: the last pc is kernel code below the kernel boundary, in no module (a
    CPU's start code copied to low memory called the kernel's first function), not user code.
    """

    pcs: tuple[int, ...]
    stop: StopReason
    exact: tuple[bool, ...] = ()
    via: tuple[Via, ...] = ()
    outer_kernel: bool = False


TRAP_SCAN = 32  # words above a kernel's fake frame searched for the trap frame


class Unwinder:
    """Walks stacks (``unwind``) and turns their addresses into frames (``resolve``)."""

    def __init__(
        self,
        arch: InstructionSet,
        *,
        kernel_boundary: int | None = None,
        max_depth: int = 128,
        lines: bool = False,
    ) -> None:
        self.kernel_boundary = arch.kernel_boundary if kernel_boundary is None else kernel_boundary
        self.max_depth = max_depth
        self.lines = lines  # resolve's default: add file:line and inlined frames
        self.arch = arch
        # Frames of resolved stacks found by following code to its return (a heuristic that
        # a run's summary counts apart): Via.SCAN.
        self.scanned = 0

    def unwind(self, regs: Registers, memory: PageCache, space: AddressSpace) -> RawStack:
        """Walk the stack ``regs`` describe. Raises ``PageMissing`` for a page the cache has
        not fetched: fetch it and call again (the walk has no side effects)."""
        arch = self.arch
        if regs.isa != arch.name:  # another word size, other registers: only the pc is known
            return RawStack((regs.pc,), StopReason.NO_CFI, (True,), (Via.REGS,))
        pc_reg, sp_reg, fp_reg = arch.pc, arch.sp, arch.fp
        cur = dict(regs.gprs)
        cur[pc_reg], cur[sp_reg], cur[fp_reg] = regs.pc, regs.sp, regs.fp
        no_module = frame_pointer_only(arch)
        pc, exact, via = regs.pc, True, Via.REGS
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
            if module is not None and module.outermost is not None:
                start, end = module.outermost
                if start <= lookup < end:  # a program's entry function: nothing called it
                    return RawStack(tuple(pcs), StopReason.END, tuple(exacts), tuple(vias))
            outcome: Found | StopReason | None = None
            for step in no_module if module is None else module.steps or no_module:
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
            jumped = flags & (EXACT | NEW_STACK | LINK) != 0
            stop = self._check(cur, new, pc, jumped, seen, space)
            if stop is not None:
                return RawStack(tuple(pcs), stop, tuple(exacts), tuple(vias))
            # A trap frame hands over to interrupted code: its pc is exact, not a return address.
            crossed = pc >= boundary > new[pc_reg]
            if crossed and space.user_gone:
                return RawStack(tuple(pcs), StopReason.USER_GONE, tuple(exacts), tuple(vias))
            if crossed and via is Via.PROLOGUE and not signal:
                user_sp = self._trap_frame(new[sp_reg], memory)
                if user_sp is None:
                    # Kernel code "returning" to user code by a plain return address is no
                    # frame at all: a syscall entry before it saved anything (the user's pc
                    # is in RCX). Stop rather than make up a caller.
                    return RawStack(tuple(pcs), StopReason.NO_CFI, tuple(exacts), tuple(vias))
                new[sp_reg] = user_sp
            # A plain return address into no file is user code only under a trap frame;
            # without one, the kernel was called from code outside every file (a CPU's start
            # code copied to 0x7000), which nothing called.
            plain = crossed and not signal and via is not Via.PROLOGUE
            if (
                plain and find(new[pc_reg] - 1) is None
                and self._trap_frame_above(new[sp_reg], new[pc_reg], memory) is None
            ):  # fmt: skip
                return RawStack(
                    (*pcs, new[pc_reg]), StopReason.END, (*exacts, False), (*vias, via),
                    outer_kernel=True,
                )  # fmt: skip
            exact = signal or crossed
            sp_guessed = crossed and via is Via.FRAME_POINTER and not signal
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
        return self.arch.trap_frame_sp(after_pc, word_reader(memory, self.arch))

    def _check(
        self,
        cur: Regs,
        new: Regs,
        pc: int,
        jumped: bool,
        seen: set[tuple[int, int]],
        space: AddressSpace,
    ) -> StopReason | None:
        """Sanity rules between a frame and its caller. ``jumped``: the caller's stack pointer
        came from a trap frame or a saved stack pointer, not from the frame's by arithmetic:
        it may lie below (another stack), or its pc from a link register (a frame that pushed
        nothing): only an exact repeat is a loop."""
        arch = self.arch
        new_pc, new_sp = new.get(arch.pc), new[arch.sp]
        if not new_pc:
            return StopReason.END
        boundary = self.kernel_boundary
        valid = arch.return_address(new_pc) is not None
        # Page 0 holds code only where a module maps it (a program linked at address 0).
        unmapped_page_0 = new_pc < 0x1000 and space.find(new_pc - 1) is None
        if not valid or unmapped_page_0 or (pc < boundary <= new_pc):
            return StopReason.BAD_RETURN  # user code never returns into the kernel
        crossing = jumped or (pc >= boundary > new_pc)
        if new_sp <= cur[arch.sp] and not crossing:
            return StopReason.LOOP
        key = (new_pc, new_sp)
        if key in seen:
            return StopReason.LOOP
        seen.add(key)
        return None

    def unplaced(self, raw: RawStack, space: AddressSpace) -> tuple[int, ...]:
        """The user addresses of ``raw`` (a pc, a return address's call) that no module of
        ``space`` holds: a space read before its process mapped that code."""
        exacts = raw.exact or (True,) + (False,) * (len(raw.pcs) - 1)
        user = raw.pcs[:-1] if raw.outer_kernel else raw.pcs
        lookups = (pc if exact else pc - 1 for pc, exact in zip(user, exacts, strict=False))
        boundary = self.kernel_boundary
        return tuple(at for at in lookups if at < boundary and space.find(at) is None)

    def resolve(self, raw: RawStack, space: AddressSpace, *, lines: bool | None = None) -> Stack:
        """The frames of a walked stack; callers are looked up at return address - 1 (the call
        instruction). The functions a caller's callee was reached through by tail jumps become
        frames of their own where the space's code tells them (``tailcall.py``). With ``lines``
        (default: the constructor's), frames get file:line and the functions inlined at a pc
        become frames of their own."""
        if lines is None:
            lines = self.lines
        self.scanned += raw.via.count(Via.SCAN)
        cache = space.frames
        boundary = self.kernel_boundary
        pcs, exacts = raw.pcs, raw.exact or (True,) + (False,) * (len(raw.pcs) - 1)
        tails = [False] * len(pcs)  # per pc: put back from a tail jump
        if space.tail_calls is not None:
            pcs, exacts, chains = with_tail_calls(pcs, exacts, space.tail_calls)
            tails = []
            for chain in chains:  # each walked pc, then the tail-call pcs found below it
                tails += [False] + [True] * (0 if chain is None else len(chain.pcs))
        frames: list[Frame] = []
        outer = len(pcs) - 1 if raw.outer_kernel else -1
        for n, (pc, exact, tail) in enumerate(zip(pcs, exacts, tails, strict=True)):
            below = 0 if n == outer else boundary  # kernel code below the boundary: kernel
            key = (pc, exact, below, lines)
            found = cache.get(key)
            if found is None:
                found = cache.put(key, frames_at(pc, exact, space, below, lines))
            # Rare (a few frames a stack at most): marked on a copy, the cache keeps one kind.
            frames += (replace(f, tail_call=True) for f in found) if tail else found
        return Stack(tuple(frames), raw.stop)
