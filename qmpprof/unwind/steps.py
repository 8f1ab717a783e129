"""The unwinding methods, one seam: each finds a frame's caller in its own way.

A module carries an ordered list of steps chosen from what it provides (``order.steps_for``):
its CFI (``.eh_frame``/``.debug_frame``), then prologue analysis of its code for the frame the
CPU was interrupted in, then frame pointers, which need nothing. The walker (``chain.py``)
tries them in order: a step returns None when it has nothing to say about this pc (the next one
is tried), a ``StopReason`` when the walk must end here, or the caller's registers. A new method
is a class with ``via`` and ``step`` and one line in ``steps_for``, or, when a guest OS brings it
(x86_64 Linux's ORC step), handed to ``steps_for`` by whoever builds the module.
Steps read memory only through the sample's ``PageCache`` and let ``PageMissing`` through.
Each step serves one instruction set (a ``qmpprof.arch`` InstructionSet): registers are its
DWARF numbers, stack words its address size, and addresses wrap at its width.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

from qmpprof.arch.base import InstructionSet
from qmpprof.dwarf.cfi import CfiTable, Kind, Rule
from qmpprof.dwarf.expr import evaluate
from qmpprof.elf.symbols import SymbolTable
from qmpprof.model import StopReason
from qmpprof.pagecache import PageCache

Regs = dict[int, int]  # DWARF register number -> value
# The caller's registers, and flags: EXACT (True) when its pc is exact (a trap or signal frame
# was crossed), NEW_STACK when its stack pointer was loaded from memory (a switch back off an
# interrupt stack), so that it may lie below the frame's, on another stack; LINK when its pc
# came from a link register (aarch64's x30): its stack pointer may equal the frame's.
EXACT, NEW_STACK, LINK = 1, 2, 4
Found = tuple[Regs, int]
Outcome = Found | StopReason | None


class Via(enum.Enum):
    """How a frame was found."""

    REGS = "regs"  # the leaf: the CPU's registers
    CFI = "cfi"
    PROLOGUE = "prologue"
    FRAME_POINTER = "frame-pointer"
    ORC = "orc"  # a Linux kernel's .orc_unwind tables
    SCAN = "scan"  # code with no CFI followed to its return (scan.py)
    ENTRY = "entry"  # a kernel's exception entry or exit code (entry.py)


class UnwindStep(Protocol):
    @property
    def via(self) -> Via: ...

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        """The caller of the frame whose registers are ``cur``. ``pc`` is the runtime address to
        look up (a caller's return address - 1); ``interrupted``: the CPU stopped at ``pc`` and
        RSP is exact. None: not this step's case; a StopReason: the walk ends here."""
        ...


class ExceptionEntry(Protocol):
    """A kernel's exception entry and exit code as the guest OS read it (``entry.EntryCode``:
    arm64's shape; ``savedregs.SavedRegsEntry``: riscv64's), and the step that crosses it.
    ``link``: the DWARF number the exception link register's value is put at for the walk,
    ``link_name`` the transport's name for it; ``user_sp``/``user_sp_name`` likewise for a user
    stack pointer apart from the general registers (None: none)."""

    @property
    def link(self) -> int: ...

    @property
    def link_name(self) -> str: ...

    @property
    def user_sp(self) -> int | None: ...

    @property
    def user_sp_name(self) -> str: ...

    def holds_link(self, pc: int) -> bool:
        """Whether at link address ``pc`` the interrupted pc may be only in the link
        register."""
        ...

    def holds_user(self, pc: int) -> bool:
        """Whether at link address ``pc`` the user's pc and stack pointer are only in the link
        register and the user stack pointer."""
        ...

    def step(self, bias: int, arch: InstructionSet) -> UnwindStep:
        """The unwinding step for this code in a module at ``bias``."""
        ...


class CfiStep:
    """The CFI row of the pc: most rows are "CFA = register + offset, registers saved at CFA+n"
    (precompiled as ``Rule.saved_at``), the rest go through the general rule interpreter."""

    via = Via.CFI
    __slots__ = ("arch", "bias", "table")

    def __init__(self, table: CfiTable, bias: int, arch: InstructionSet) -> None:
        self.table = table
        self.bias = bias
        self.arch = arch

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        rule = self.table.row_for(pc - self.bias)
        if rule is None:
            return None
        found = _fast_cfi(rule, cur, self.arch, memory) or _apply(rule, cur, memory, self.arch)
        if not isinstance(found, tuple) or rule.signal or rule.ra == self.arch.pc:
            return found  # a pc saved as such (a signal frame's) carries no code
        new, flags = found
        ra = new.get(self.arch.pc)
        plain = None if ra is None else self.arch.return_address(ra)
        if plain is not None and plain != ra:  # a pointer-authentication code taken off (aarch64)
            new[self.arch.pc] = plain
        if interrupted and _in_register(rule):
            # Still in its link register (a leaf, a prologue: aarch64's x30, riscv64's ra), the
            # caller's stack pointer may be the frame's own.
            flags |= LINK
        return new, flags


class PrologueStep:
    """Prologue/epilogue analysis of the interrupted frame's code (no CFI at its pc): the
    return address where the rule says, on the stack or still in a link register."""

    via = Via.PROLOGUE
    __slots__ = ("arch", "bias", "code", "code_addr", "symbols")

    def __init__(
        self,
        code: bytes,
        code_addr: int,
        bias: int,
        symbols: SymbolTable | None,
        arch: InstructionSet,
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
        extent = None if self.symbols is None else self.symbols.extent(link_pc)
        func_start, func_end = (None, None) if extent is None else extent
        arch = self.arch
        rule = arch.prologue(self.code, self.code_addr, link_pc, func_start, func_end)
        if rule is None:
            return None
        mask, read = arch.mask, word_reader(memory, arch)
        cfa = (cur[arch.sp] + rule.cfa_offset) & mask
        if rule.ra_register is not None:
            ra = cur.get(rule.ra_register)
            if ra is None:
                return None  # the register was not read: frame pointers then
        else:
            offset = -arch.address_size if rule.ra_offset is None else rule.ra_offset
            ra = read((cfa + offset) & mask)
            if ra is None:
                return StopReason.READ_FAILED
        plain = arch.return_address(ra)  # a pointer-authentication code taken off (aarch64)
        fp_slot = None if rule.fp_offset is None else cfa + rule.fp_offset
        found = caller(cur, arch, ra if plain is None else plain, cfa, fp_slot, read)
        if rule.ra_register is None or not isinstance(found, tuple):
            return found
        return found[0], LINK


class FramePointerStep:
    """The frame record the frame pointer points at (``frame_record``) holds the caller's frame
    pointer and the return address (the psABI's frame chain: [rbp] and [rbp+8] on x86_64, [ebp]
    and [ebp+4] on i386, a frame record [x29] and [x29+8] on aarch64, whose return address may
    carry a pointer-authentication code; [s0-16] and [s0-8] on riscv64)."""

    via = Via.FRAME_POINTER
    __slots__ = ("arch",)

    def __init__(self, arch: InstructionSet) -> None:
        self.arch = arch

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        arch = self.arch
        word, mask = arch.address_size, arch.mask
        fp = cur.get(arch.fp, 0)
        if fp == 0:
            return StopReason.END  # the outermost frame clears the frame pointer (psABI)
        if fp < cur[arch.sp] or fp & (word - 1):
            return StopReason.NO_CFI  # not a frame pointer into this stack
        read = word_reader(memory, arch)
        fp_at, ra_at, sp_at = arch.frame_record
        saved_fp = read((fp + fp_at) & mask)
        ra = read((fp + ra_at) & mask)
        if saved_fp is None or ra is None:
            return StopReason.READ_FAILED
        plain = arch.return_address(ra)  # a pointer-authentication code taken off (aarch64)
        new = dict(cur)
        new[arch.pc] = ra if plain is None else plain
        new[arch.fp], new[arch.sp] = saved_fp, (fp + sp_at) & mask
        return new, False


# By the instruction set itself: one of several translation settings (aarch64) has its own.
_FRAME_POINTER_ONLY: dict[InstructionSet, tuple[UnwindStep, ...]] = {}


def frame_pointer_only(arch: InstructionSet) -> tuple[UnwindStep, ...]:
    """The steps of code known only by its range (no module): frame pointers."""
    found = _FRAME_POINTER_ONLY.get(arch)
    if found is None:
        found = _FRAME_POINTER_ONLY[arch] = (FramePointerStep(arch),)
    return found


def caller(
    cur: Regs,
    arch: InstructionSet,
    ra: int,
    sp: int,
    fp_slot: int | None,
    read: Callable[[int], int | None],
) -> Outcome:
    """The caller's registers: its pc ``ra``, its stack pointer ``sp``, its frame pointer read
    at ``fp_slot`` (None: the frame's own, untouched)."""
    new = dict(cur)
    new[arch.pc], new[arch.sp] = ra, sp
    if fp_slot is not None:
        fp = read(fp_slot & arch.mask)
        if fp is None:
            return StopReason.READ_FAILED
        new[arch.fp] = fp
    return new, False


def _in_register(rule: Rule) -> bool:
    """Whether the row leaves the return address in a register (its column a register of
    its own kept, or copied from another), not saved in memory."""
    found = rule.reg(rule.ra)
    return found is None or found.kind in (Kind.SAME, Kind.REGISTER)


def word_reader(memory: PageCache, arch: InstructionSet) -> Callable[[int], int | None]:
    return memory.read_u64 if arch.address_size == 8 else memory.read_u32


def _fast_cfi(rule: Rule, cur: Regs, arch: InstructionSet, memory: PageCache) -> Outcome:
    """Most frames: CFA = register + offset, registers saved at CFA+n. None: not this case."""
    saved_at = rule.saved_at
    if saved_at is None or rule.cfa_expr is not None:
        return None
    base = cur.get(rule.cfa_reg)
    if base is None:
        return None
    mask = arch.mask
    read = word_reader(memory, arch)
    cfa = (base + rule.cfa_offset) & mask
    new = cur.copy()
    new[arch.sp] = cfa  # the CFA is the caller's stack pointer, unless a rule says otherwise
    for reg, offset in saved_at:
        value = read((cfa + offset) & mask)
        if value is None:
            return StopReason.READ_FAILED
        new[reg] = value
    if rule.ra != arch.pc:
        new[arch.pc] = new[rule.ra]
    return new, rule.signal


def _apply(rule: Rule, cur: Regs, memory: PageCache, arch: InstructionSet) -> Found | StopReason:
    """The caller's registers from one CFI row, any rule kind, in ``arch``'s register numbers
    and word size (addresses wrap at its width; a dereference reads exactly its size)."""
    read = word_reader(memory, arch)
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
