"""The unwinding methods, one seam: each finds a frame's caller in its own way.

A module carries an ordered list of steps chosen from what it provides (``steps_for``): its CFI
(``.eh_frame``/``.debug_frame``), then prologue analysis of its code for the frame the CPU was
interrupted in, then frame pointers, which need nothing. The walker (``chain.py``) tries them in
order: a step returns None when it has nothing to say about this pc (the next one is tried), a
``StopReason`` when the walk must end here, or the caller's registers. A new method (ORC for
Linux kernels) is a class with ``via`` and ``step`` and one line in ``steps_for``.
Steps read memory only through the sample's ``PageCache`` and let ``PageMissing`` through.
Each step serves one instruction set (``qmpprof.dwarf.arch``): on i386 the registers are i386
DWARF numbers (eip 8, esp 4, ebp 5), stack words are 4 bytes and addresses wrap at 32 bits.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import cache
from typing import Protocol

from qmpprof.dwarf.arch import X86_64, Arch
from qmpprof.dwarf.cfi import CfiTable, Kind, Rule
from qmpprof.dwarf.expr import evaluate
from qmpprof.elf.symbols import SymbolTable
from qmpprof.model import RBP, RIP, RSP, StopReason
from qmpprof.pages import PageCache
from qmpprof.unwind.prologue import PrologueAnalyzer

MASK64 = (1 << 64) - 1

Regs = dict[int, int]  # DWARF register number -> value
# The caller's registers, and flags: EXACT (True) when its pc is exact (a trap or signal frame
# was crossed), NEW_STACK when its stack pointer was loaded from memory (a switch back off an
# interrupt stack), so that it may lie below the frame's, on another stack.
EXACT, NEW_STACK = 1, 2
Found = tuple[Regs, int]
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
    __slots__ = ("arch", "bias", "table")

    def __init__(self, table: CfiTable, bias: int, arch: Arch = X86_64) -> None:
        self.table = table
        self.bias = bias
        self.arch = arch

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        rule = self.table.row_for(pc - self.bias)
        if rule is None:
            return None
        if self.arch is X86_64:
            return _fast_cfi(rule, cur, memory.read_u64) or _apply(rule, cur, memory)
        return _apply(rule, cur, memory, self.arch)


class PrologueStep:
    """Prologue/epilogue analysis of the interrupted frame's code (no CFI at its pc)."""

    via = Via.PROLOGUE
    __slots__ = ("arch", "bias", "code", "code_addr", "symbols")

    def __init__(
        self,
        code: bytes,
        code_addr: int,
        bias: int,
        symbols: SymbolTable | None,
        arch: Arch = X86_64,
    ) -> None:
        self.code = code
        self.code_addr = code_addr  # link address of code[0]
        self.bias = bias
        self.symbols = symbols
        self.arch = arch

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        if not interrupted:
            return None  # a caller stands at a call site, where frame pointers are right
        link_pc = pc - self.bias
        func_start = None
        if self.symbols is not None:
            hit = self.symbols.lookup(link_pc)
            func_start = None if hit is None else link_pc - hit[1]
        arch = self.arch
        rule = _analyzer(arch.address_size).analyze(self.code, self.code_addr, link_pc, func_start)
        if rule is None:
            return None
        mask, read = arch.mask, word_reader(memory, arch)
        cfa = (cur[arch.sp] + rule.cfa_offset) & mask
        ra = read((cfa - arch.address_size) & mask)
        if ra is None:
            return StopReason.READ_FAILED
        new = dict(cur)
        new[arch.pc], new[arch.sp] = ra, cfa
        if rule.rbp_offset is not None:
            rbp = read((cfa + rule.rbp_offset) & mask)
            if rbp is None:
                return StopReason.READ_FAILED
            new[arch.fp] = rbp
        return new, False


class FramePointerStep:
    """[RBP] is the caller's RBP, [RBP+8] the return address (the psABI's frame chain); on i386
    [EBP] and [EBP+4]."""

    via = Via.FRAME_POINTER
    __slots__ = ("arch",)

    def __init__(self, arch: Arch = X86_64) -> None:
        self.arch = arch

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        if self.arch is not X86_64:
            return self._step32(cur, memory)
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

    def _step32(self, cur: Regs, memory: PageCache) -> Outcome:
        arch = self.arch
        word = arch.address_size
        fp = cur.get(arch.fp, 0)
        if fp == 0:
            return StopReason.END
        if fp < cur[arch.sp] or fp & (word - 1):
            return StopReason.NO_CFI
        saved_fp = memory.read_u32(fp)
        ra = memory.read_u32((fp + word) & arch.mask)
        if saved_fp is None or ra is None:
            return StopReason.READ_FAILED
        new = dict(cur)
        new[arch.pc], new[arch.fp], new[arch.sp] = ra, saved_fp, (fp + 2 * word) & arch.mask
        return new, False


FRAME_POINTER = FramePointerStep()
FRAME_POINTER_ONLY: tuple[UnwindStep, ...] = (FRAME_POINTER,)


@cache
def frame_pointer_only(arch: Arch) -> tuple[UnwindStep, ...]:
    """The steps of code known only by its range (no module): frame pointers."""
    return FRAME_POINTER_ONLY if arch is X86_64 else (FramePointerStep(arch),)


def steps_for(
    bias: int,
    cfi: CfiTable | None = None,
    code: bytes | None = None,
    code_addr: int = 0,
    symbols: SymbolTable | None = None,
    arch: Arch = X86_64,
) -> tuple[UnwindStep, ...]:
    """The steps for a module at ``bias``, from what it provides, best first."""
    steps: list[UnwindStep] = []
    if cfi is not None:
        steps.append(CfiStep(cfi, bias, arch))
    if code:
        _analyzer(arch.address_size)  # made now: not inside the first pause that needs it
        steps.append(PrologueStep(code, code_addr, bias, symbols, arch))
    steps.extend(frame_pointer_only(arch))
    return tuple(steps)


@cache
def _analyzer(word: int = 8) -> PrologueAnalyzer:
    # One analyzer (one capstone handle, one cache) per instruction set serves every module.
    return PrologueAnalyzer(word)


def word_reader(memory: PageCache, arch: Arch) -> Callable[[int], int | None]:
    return memory.read_u64 if arch.address_size == 8 else memory.read_u32


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


def _apply(rule: Rule, cur: Regs, memory: PageCache, arch: Arch = X86_64) -> Found | StopReason:
    """The caller's registers from one CFI row, any rule kind, in ``arch``'s register numbers
    and word size (addresses wrap at its width; a dereference reads exactly its size)."""
    read = memory.read_u64 if arch.address_size == 8 else memory.read_u32
    mask = arch.mask

    def run(expr: bytes | None, push: int | None = None) -> int | None:
        return evaluate(expr or b"", cur, memory.read_u64, push, arch.address_size, memory.read)

    if rule.cfa_expr is None:
        base = cur.get(rule.cfa_reg)
        if base is None:
            return StopReason.NO_CFI
        cfa = (base + rule.cfa_offset) & mask
    else:
        value = run(rule.cfa_expr)
        if value is None:
            return StopReason.NO_CFI
        cfa = value
    new = dict(cur)
    new[arch.sp] = cfa  # the CFA is the caller's stack pointer, unless a rule says otherwise
    for reg, rr in rule.regs:
        kind = rr.kind
        if kind is Kind.OFFSET:
            saved = read((cfa + rr.value) & mask)
        elif kind is Kind.VAL_OFFSET:
            saved = (cfa + rr.value) & mask
        elif kind is Kind.REGISTER:
            saved = cur.get(rr.value)
        elif kind is Kind.SAME:
            saved = cur.get(reg)
        elif kind is Kind.UNDEFINED:
            new.pop(reg, None)
            continue
        else:
            saved = run(rr.expr, cfa)
            if saved is not None and kind is Kind.EXPRESSION:
                saved = read(saved)
        if saved is None:
            if kind in (Kind.REGISTER, Kind.SAME):
                new.pop(reg, None)
                continue
            return StopReason.READ_FAILED
        new[reg] = saved
    if rule.ra != arch.pc:
        ra = new.get(rule.ra)
        if ra is None:
            new.pop(arch.pc, None)
        else:
            new[arch.pc] = ra
    elif rule.reg(arch.pc) is None:
        return StopReason.NO_CFI  # a row that does not say where the return address is
    return new, rule.signal
