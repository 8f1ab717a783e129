"""The unwinding methods, one seam: each finds a frame's caller in its own way.

A module carries an ordered list of steps chosen from what it provides (``steps_for``): its CFI
(``.eh_frame``/``.debug_frame``), then prologue analysis of its code for the frame the CPU was
interrupted in, then frame pointers, which need nothing. The walker (``chain.py``) tries them in
order: a step returns None when it has nothing to say about this pc (the next one is tried), a
``StopReason`` when the walk must end here, or the caller's registers. A new method (ORC for
Linux kernels) is a class with ``via`` and ``step`` and one line in ``steps_for``.
Steps read memory only through the sample's ``PageCache`` and let ``PageMissing`` through.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import cache
from typing import Protocol

from qmpprof.dwarf.cfi import CfiTable, Kind, Rule
from qmpprof.dwarf.expr import evaluate
from qmpprof.elf.symbols import SymbolTable
from qmpprof.model import RBP, RIP, RSP, StopReason
from qmpprof.pages import PageCache
from qmpprof.unwind.prologue import PrologueAnalyzer

MASK64 = (1 << 64) - 1

Regs = dict[int, int]  # DWARF register number -> value
# The caller's registers, and whether its pc is exact (a trap or signal frame was crossed).
Found = tuple[Regs, bool]
Outcome = Found | StopReason | None


class Via(enum.Enum):
    """How a frame was found."""

    REGS = "regs"  # the leaf: the CPU's registers
    CFI = "cfi"
    PROLOGUE = "prologue"
    FRAME_POINTER = "frame-pointer"
    ORC = "orc"  # a Linux kernel's .orc_unwind tables


class UnwindStep(Protocol):
    @property
    def via(self) -> Via: ...

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        """The caller of the frame whose registers are ``cur``. ``pc`` is the runtime address to
        look up (a caller's return address - 1); ``interrupted``: the CPU stopped at ``pc`` and
        RSP is exact. None: not this step's case; a StopReason: the walk ends here."""
        ...


class CfiStep:
    """The CFI row of the pc: most rows are "CFA = register + offset, registers saved at CFA+n"
    (precompiled as ``Rule.saved_at``), the rest go through the general rule interpreter."""

    via = Via.CFI
    __slots__ = ("bias", "table")

    def __init__(self, table: CfiTable, bias: int) -> None:
        self.table = table
        self.bias = bias

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        rule = self.table.row_for(pc - self.bias)
        if rule is None:
            return None
        return _fast_cfi(rule, cur, memory.read_u64) or _apply(rule, cur, memory)


class PrologueStep:
    """Prologue/epilogue analysis of the interrupted frame's code (no CFI at its pc)."""

    via = Via.PROLOGUE
    __slots__ = ("bias", "code", "code_addr", "symbols")

    def __init__(self, code: bytes, code_addr: int, bias: int, symbols: SymbolTable | None) -> None:
        self.code = code
        self.code_addr = code_addr  # link address of code[0]
        self.bias = bias
        self.symbols = symbols

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        if not interrupted:
            return None  # a caller stands at a call site, where frame pointers are right
        link_pc = pc - self.bias
        func_start = None
        if self.symbols is not None:
            hit = self.symbols.lookup(link_pc)
            func_start = None if hit is None else link_pc - hit[1]
        rule = _analyzer().analyze(self.code, self.code_addr, link_pc, func_start)
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
        return new, False


class FramePointerStep:
    """[RBP] is the caller's RBP, [RBP+8] the return address (the psABI's frame chain)."""

    via = Via.FRAME_POINTER
    __slots__ = ()

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
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
        return new, False


FRAME_POINTER = FramePointerStep()
FRAME_POINTER_ONLY: tuple[UnwindStep, ...] = (FRAME_POINTER,)


def steps_for(
    bias: int,
    cfi: CfiTable | None = None,
    code: bytes | None = None,
    code_addr: int = 0,
    symbols: SymbolTable | None = None,
) -> tuple[UnwindStep, ...]:
    """The steps for a module at ``bias``, from what it provides, best first."""
    steps: list[UnwindStep] = []
    if cfi is not None:
        steps.append(CfiStep(cfi, bias))
    if code:
        _analyzer()  # made now: not inside the first pause that needs it
        steps.append(PrologueStep(code, code_addr, bias, symbols))
    steps.append(FRAME_POINTER)
    return tuple(steps)


@cache
def _analyzer() -> PrologueAnalyzer:
    # One analyzer (one capstone handle, one cache) serves every module.
    return PrologueAnalyzer()


def _fast_cfi(rule: Rule, cur: Regs, read: Callable[[int], int | None]) -> Outcome:
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
    return new, rule.signal


def _apply(rule: Rule, cur: Regs, memory: PageCache) -> Found | StopReason:
    """The caller's registers from one CFI row, any rule kind."""
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
    return new, rule.signal
