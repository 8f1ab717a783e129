"""The stack walker: registers + stack memory + known code -> the chain of return addresses.

For each frame it tries, in order: the CFI row of the pc (``cfi.py``); for the frame the CPU
was interrupted in, prologue/epilogue analysis (``prologue.py``); then frame pointers. It reads
memory only through ``PageCache`` and lets ``PageMissing`` propagate, so the sampler can fetch
the page while the guest is stopped and simply call ``unwind`` again: the walk is pure.
Every way a walk can end is a ``StopReason``; nothing here raises for bad stacks.
Synchronous on purpose: no asyncio, no transport.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from qmpprof.memory import PageCache
from qmpprof.model import KERNEL_BOUNDARY, RBP, RIP, RSP, Frame, Registers, Stack, StopReason
from qmpprof.unwind.cfi import Kind, Rule
from qmpprof.unwind.expr import evaluate
from qmpprof.unwind.prologue import PrologueAnalyzer
from qmpprof.unwind.space import AddressSpace, Module
from qmpprof.unwind.symbolize import frames_at

__all__ = ["AddressSpace", "Module", "RawStack", "Unwinder", "Via"]

MASK64 = (1 << 64) - 1
_CACHE_LIMIT = 1 << 16


class Via(enum.Enum):
    """How a frame was found."""

    REGS = "regs"  # the leaf: the CPU's registers
    CFI = "cfi"
    PROLOGUE = "prologue"
    FRAME_POINTER = "frame-pointer"


@dataclass(frozen=True, slots=True)
class RawStack:
    """Return addresses leaf first. ``exact[i]``: pcs[i] is where the CPU was (the leaf, or code
    interrupted by a trap/signal frame), not a return address. ``via[i]``: how frame i was found."""

    pcs: tuple[int, ...]
    stop: StopReason
    exact: tuple[bool, ...] = ()
    via: tuple[Via, ...] = ()


def _canonical(pc: int) -> bool:
    return pc < 0x0000_8000_0000_0000 or pc >= 0xFFFF_8000_0000_0000


class Unwinder:
    """Walks stacks (``unwind``) and names their frames (``symbolize``)."""

    def __init__(
        self, *, kernel_boundary: int = KERNEL_BOUNDARY, max_depth: int = 128, lines: bool = False
    ) -> None:
        self.kernel_boundary = kernel_boundary
        self.max_depth = max_depth
        self.lines = lines  # symbolize's default: add file:line and inlined frames (--lines)
        self._prologue = PrologueAnalyzer()

    def unwind(self, regs: Registers, memory: PageCache, space: AddressSpace) -> RawStack:
        """Walk the stack ``regs`` describe. Raises ``PageMissing`` for a page the cache has
        not fetched: fetch it and call again (the walk has no side effects)."""
        if not regs.long_mode:  # 32-bit or real-mode code: 8-byte stack slots would be wrong
            return RawStack((regs.rip,), StopReason.NO_CFI, (True,), (Via.REGS,))
        cur = dict(regs.gprs)
        cur[RIP], cur[RSP], cur[RBP] = regs.rip, regs.rsp, regs.rbp
        pc, exact, via = regs.rip, True, Via.REGS
        pcs: list[int] = []
        exacts: list[bool] = []
        vias: list[Via] = []
        seen: set[tuple[int, int]] = set()
        sp_guessed = False  # RSP is a stand-in, too rough for prologue analysis
        read = memory.read_u64
        rule_at = space.rule_at
        step: tuple[dict[int, int], Via, bool] | StopReason | None
        for _ in range(self.max_depth):
            pcs.append(pc)
            exacts.append(exact)
            vias.append(via)
            module, rule = rule_at(pc if exact else pc - 1)
            step = None if rule is None else _fast_cfi_step(rule, cur, read)
            if step is None:
                step = self._slow_step(cur, pc, exact and not sp_guessed, memory, module, rule)
            if isinstance(step, StopReason):
                return RawStack(tuple(pcs), step, tuple(exacts), tuple(vias))
            new, via, signal = step
            stop = self._check(cur, new, pc, signal, seen)
            if stop is not None:
                return RawStack(tuple(pcs), stop, tuple(exacts), tuple(vias))
            # A trap frame hands over to interrupted code: its pc is exact, not a return address.
            crossed = pc >= self.kernel_boundary > new[RIP]
            exact = signal or crossed
            sp_guessed = crossed and via is Via.FRAME_POINTER
            if sp_guessed and new.get(RBP):
                # A kernel's fake frame [rbp, interrupted rip] gives no user RSP; the user RBP
                # bounds it from above, which is all the next frame-pointer step needs.
                new[RSP] = new[RBP]
            cur, pc = new, new[RIP]
        return RawStack(tuple(pcs), StopReason.DEPTH, tuple(exacts), tuple(vias))

    def _check(
        self,
        cur: dict[int, int],
        new: dict[int, int],
        pc: int,
        signal: bool,
        seen: set[tuple[int, int]],
    ) -> StopReason | None:
        """Sanity rules between a frame and its caller."""
        new_pc, new_sp = new.get(RIP), new[RSP]
        if not new_pc:
            return StopReason.END
        boundary = self.kernel_boundary
        if not _canonical(new_pc) or new_pc < 0x1000 or (pc < boundary <= new_pc):
            return StopReason.BAD_RETURN  # user code never returns into the kernel
        crossing = signal or (pc >= boundary > new_pc)
        if new_sp <= cur[RSP] and not crossing:
            return StopReason.LOOP
        key = (new_pc, new_sp)
        if key in seen:
            return StopReason.LOOP
        seen.add(key)
        return None

    def _slow_step(
        self,
        cur: dict[int, int],
        pc: int,
        interrupted: bool,
        memory: PageCache,
        module: Module | None,
        rule: Rule | None,
    ) -> tuple[dict[int, int], Via, bool] | StopReason:
        """CFI rows beyond the fast path, then the fallbacks."""
        if rule is not None:
            return _apply(rule, cur, memory)
        if interrupted and module is not None and module.code is not None:
            step = self._prologue_step(module, module.code, cur, pc, memory)
            if step is not None:
                return step
        return _frame_pointer_step(cur, memory)

    def _prologue_step(
        self, module: Module, code: bytes, cur: dict[int, int], pc: int, memory: PageCache
    ) -> tuple[dict[int, int], Via, bool] | StopReason | None:
        link_pc = pc - module.bias
        func_start = None
        if module.symbols is not None:
            hit = module.symbols.lookup(link_pc)
            func_start = None if hit is None else link_pc - hit[1]
        rule = self._prologue.analyze(code, module.code_addr, link_pc, func_start)
        if rule is None:
            return None
        cfa = (cur[RSP] + rule.cfa_offset) & MASK64
        ra = memory.read_u64((cfa - 8) & MASK64)
        if ra is None:
            return StopReason.READ_FAILED
        new = dict(cur)
        new[RIP], new[RSP] = ra, cfa
        if rule.rbp_offset is not None:
            rbp = memory.read_u64((cfa + rule.rbp_offset) & MASK64)
            if rbp is None:
                return StopReason.READ_FAILED
            new[RBP] = rbp
        return new, Via.PROLOGUE, False

    def symbolize(self, raw: RawStack, space: AddressSpace, *, lines: bool | None = None) -> Stack:
        """Name each frame; callers are looked up at return address - 1 (the call instruction).
        With ``lines`` (default: the constructor's), frames get file:line and the functions
        inlined at a pc become frames of their own."""
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
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                found = cache[key] = frames_at(pc, exact, space, boundary, lines)
            frames += found
        return Stack(tuple(frames), raw.stop)


def _fast_cfi_step(
    rule: Rule, cur: dict[int, int], read: Callable[[int], int | None]
) -> tuple[dict[int, int], Via, bool] | StopReason | None:
    """Most frames: CFA = register + offset, registers saved at CFA+n. None: not this case."""
    saved_at = rule.saved_at
    if saved_at is None or rule.cfa_expr is not None:
        return None
    base = cur.get(rule.cfa_reg)
    if base is None:
        return None
    cfa = (base + rule.cfa_offset) & MASK64
    new = cur.copy()
    new[RSP] = cfa  # on x86_64 the CFA is the caller's stack pointer, unless a rule says otherwise
    for reg, offset in saved_at:
        value = read((cfa + offset) & MASK64)
        if value is None:
            return StopReason.READ_FAILED
        new[reg] = value
    if rule.ra != RIP:
        new[RIP] = new[rule.ra]
    return new, Via.CFI, rule.signal


def _apply(
    rule: Rule, cur: dict[int, int], memory: PageCache
) -> tuple[dict[int, int], Via, bool] | StopReason:
    """The caller's registers from one CFI row."""
    read = memory.read_u64
    if rule.cfa_expr is None:
        base = cur.get(rule.cfa_reg)
        if base is None:
            return StopReason.NO_CFI
        cfa = (base + rule.cfa_offset) & MASK64
    else:
        value = evaluate(rule.cfa_expr, cur, read)
        if value is None:
            return StopReason.NO_CFI
        cfa = value
    new = dict(cur)
    new[RSP] = cfa  # on x86_64 the CFA is the caller's stack pointer, unless a rule says otherwise
    for reg, rr in rule.regs:
        kind = rr.kind
        if kind is Kind.OFFSET:
            saved = read((cfa + rr.value) & MASK64)
        elif kind is Kind.VAL_OFFSET:
            saved = (cfa + rr.value) & MASK64
        elif kind is Kind.REGISTER:
            saved = cur.get(rr.value)
        elif kind is Kind.SAME:
            saved = cur.get(reg)
        elif kind is Kind.UNDEFINED:
            new.pop(reg, None)
            continue
        else:
            saved = evaluate(rr.expr, cur, read, push=cfa)
            if saved is not None and kind is Kind.EXPRESSION:
                saved = read(saved)
        if saved is None:
            if kind in (Kind.REGISTER, Kind.SAME):
                new.pop(reg, None)
                continue
            return StopReason.READ_FAILED
        new[reg] = saved
    if rule.ra != RIP:
        ra = new.get(rule.ra)
        if ra is None:
            new.pop(RIP, None)
        else:
            new[RIP] = ra
    elif rule.reg(RIP) is None:
        return StopReason.NO_CFI  # a row that does not say where the return address is
    return new, Via.CFI, rule.signal


def _frame_pointer_step(
    cur: dict[int, int], memory: PageCache
) -> tuple[dict[int, int], Via, bool] | StopReason:
    rbp = cur.get(RBP, 0)
    if rbp == 0:
        return StopReason.END  # the outermost frame clears RBP (psABI 3.4.1)
    if rbp < cur[RSP] or rbp & 7:
        return StopReason.NO_CFI  # RBP is not a frame pointer into this stack
    saved_rbp = memory.read_u64(rbp)
    ra = memory.read_u64((rbp + 8) & MASK64)
    if saved_rbp is None or ra is None:
        return StopReason.READ_FAILED
    new = dict(cur)
    new[RIP], new[RBP], new[RSP] = ra, saved_rbp, (rbp + 16) & MASK64
    return new, Via.FRAME_POINTER, False
