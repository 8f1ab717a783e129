"""x86 machine code read with capstone (confined here): prologue/epilogue analysis for the
frame the CPU stopped in when it has no CFI, and a function's jumps (for tail-call frames).

Frame pointers are wrong at a few places even in code built with them: at a function's first
instruction (before ``push rbp``), between ``push rbp`` and ``mov rbp, rsp``, at ``ret`` after
the frame was torn down, and in leaf functions that never set one up. This module disassembles
the function from its start up to the pc (capstone is confined here) and tracks how far the
stack pointer is below the CFA. The answer is only needed for the interrupted frame: a caller
is always at a call site, where its frame is fully set up. One analyzer reads one instruction
set: x86_64 (8-byte pushes, rsp/rbp) or i386 (4-byte pushes, esp/ebp). capstone is imported
when the first analyzer is made (a module with code to scan), not by a run that never scans:
a Linux kernel unwound by ORC.

``branches`` lists the jumps of a piece of code: ``jmp`` and the conditional ones (loop and
jrcxz never leave a function), with their targets when they are direct.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from qmpprof.arch.base import PrologueRule
from qmpprof.arch.prologuecache import CachedAnalysis
from qmpprof.arch.x86scan import ReturnScanner

# Functions longer than this are not scanned: the linear scan is a heuristic, and a sample
# must not spend milliseconds disassembling.
_MAX_SCAN = 4096


@dataclass(frozen=True, slots=True)
class _Isa:
    """What the scan needs of an instruction set: capstone's mode, the stack word, the names."""

    mode: str  # the name of capstone's constant
    word: int
    sp: str
    fp: str

    @property
    def lea_sp(self) -> re.Pattern[str]:
        return re.compile(rf"{self.sp}, \[{self.fp} - (0x[0-9a-f]+|\d+)\]")


_ISAS = {
    8: _Isa("CS_MODE_64", 8, "rsp", "rbp"),
    4: _Isa("CS_MODE_32", 4, "esp", "ebp"),
}


@dataclass(slots=True)
class _Scan:
    depth: int = 0  # bytes pushed since entry, below the return address
    rbp_saved_at: int | None = None  # depth right after `push rbp`
    frame_depth: int | None = None  # depth when `mov rbp, rsp` ran (frame pointer live)

    def copy(self) -> _Scan:
        return _Scan(self.depth, self.rbp_saved_at, self.frame_depth)

    def rule(self, word: int) -> PrologueRule | None:
        if self.frame_depth is not None:
            return None  # RBP is a valid frame pointer here: the frame-pointer walk is exact
        rbp = None if self.rbp_saved_at is None else -word - self.rbp_saved_at
        return PrologueRule(word + self.depth, rbp)


class PrologueAnalyzer:
    """Caches one answer per (code, pc); one analyzer serves every address space of its
    instruction set (``word``: 8 for x86_64, 4 for i386)."""

    def __init__(self, word: int = 8) -> None:
        self._isa = _ISAS[word]
        self._lea_sp = self._isa.lea_sp
        import capstone  # 50 ms: only for runs that scan code (see the module's docstring)

        self._cs = capstone.Cs(capstone.CS_ARCH_X86, getattr(capstone, self._isa.mode))
        self._cached = CachedAnalysis(self._analyze)

    def analyze(
        self,
        code: bytes,
        code_addr: int,
        pc: int,
        func_start: int | None,
        func_end: int | None = None,
    ) -> PrologueRule | None:
        """How to find the caller at link address ``pc`` inside ``code`` (which starts at
        ``code_addr``); ``func_start`` comes from the symbol table (``func_end``: not needed
        here). None: use frame pointers."""
        return self._cached.analyze(code, code_addr, pc, func_start, func_end)

    @property
    def cs(self) -> object:
        """The capstone handle (for ``x86scan``, which follows code to its return)."""
        return self._cs

    def disasm(self, code: bytes, addr: int) -> Iterator[tuple[int, int, str, str]]:
        """(address, size, mnemonic, operands) of each instruction of ``code`` at ``addr``."""
        yield from self._cs.disasm_lite(code, addr)

    def _insn_at(self, code: bytes, code_addr: int, pc: int) -> tuple[str, str] | None:
        off = pc - code_addr
        if not 0 <= off < len(code):
            return None
        for _addr, _size, mnemonic, op_str in self._cs.disasm_lite(code[off : off + 16], pc, 1):
            return mnemonic, op_str
        return None

    def _analyze(
        self, code: bytes, code_addr: int, pc: int, func_start: int | None, _end: int | None
    ) -> PrologueRule | None:
        here = self._insn_at(code, code_addr, pc)
        if here is None:
            return None
        if here[0] == "ret":
            return PrologueRule(self._isa.word)  # epilogue done: only the return address is left
        if func_start is None or not 0 <= pc - func_start <= _MAX_SCAN:
            return self._without_symbol(code, code_addr, pc, here)
        start = func_start - code_addr
        if start < 0:
            return None
        return self._scan(code[start : pc - code_addr], func_start)

    def _without_symbol(
        self, code: bytes, code_addr: int, pc: int, here: tuple[str, str]
    ) -> PrologueRule | None:
        isa = self._isa
        if here == ("push", isa.fp):
            return PrologueRule(isa.word)  # most likely a function's first instruction
        before = pc - code_addr - 1
        if here == ("mov", f"{isa.fp}, {isa.sp}") and before >= 0 and code[before] == 0x55:
            return PrologueRule(2 * isa.word, -2 * isa.word)  # right after `push rbp`
        return None

    def _scan(self, body: bytes, func_start: int) -> PrologueRule | None:
        state = _Scan()
        body_state = state.copy()  # the state before the current epilogue run started
        for _addr, _size, mnemonic, op_str in self._cs.disasm_lite(body, func_start):
            if mnemonic in ("ret", "jmp"):
                # Code after an early return is reached by a jump from the body: the stack
                # is as it was before that epilogue began.
                state = body_state.copy()
                continue
            epilogue = mnemonic in ("pop", "leave") or (
                mnemonic == "add" and op_str.startswith(f"{self._isa.sp},")
            )
            if not epilogue:
                body_state = state.copy()
            if not self._track(state, mnemonic, op_str):
                return None
        return state.rule(self._isa.word)

    def _track(self, state: _Scan, mnemonic: str, op_str: str) -> bool:
        """Apply one instruction's effect on the stack; False if it moves RSP unpredictably."""
        word, sp, fp = self._isa.word, self._isa.sp, self._isa.fp
        if mnemonic == "push":
            state.depth += word
            if op_str == fp and state.rbp_saved_at is None:
                state.rbp_saved_at = state.depth
        elif mnemonic == "pop":
            if op_str == fp and state.rbp_saved_at == state.depth:
                state.rbp_saved_at = None
                state.frame_depth = None
            state.depth -= word
        elif mnemonic == "leave":
            if state.frame_depth is None:
                return False
            state.depth = state.frame_depth - word
            state.frame_depth = None
            state.rbp_saved_at = None
        elif mnemonic == "mov" and op_str == f"{fp}, {sp}":
            state.frame_depth = state.depth
        elif mnemonic in ("sub", "add") and op_str.startswith(f"{sp}, "):
            try:
                amount = int(op_str[5:], 0)
            except ValueError:
                return False
            state.depth += amount if mnemonic == "sub" else -amount
        elif (
            mnemonic == "lea"
            and state.frame_depth is not None
            and (m := self._lea_sp.fullmatch(op_str))
        ):
            state.depth = state.frame_depth + int(m[1], 0)  # epilogue of a frame with saved regs
        elif op_str.startswith(f"{sp},") and mnemonic not in ("cmp", "test"):
            return state.frame_depth is not None  # e.g. `and rsp, -16`: fine under a frame pointer
        return state.depth >= 0


@cache
def analyzer(word: int) -> PrologueAnalyzer:
    """One analyzer (one capstone handle, one cache) per instruction set serves every module."""
    return PrologueAnalyzer(word)


@cache
def scanner(word: int) -> ReturnScanner:
    """One return scanner (and cache) per instruction set, on the analyzer's capstone handle."""
    return ReturnScanner(analyzer(word).cs, word)


_CONDITIONS = ("a", "ae", "b", "be", "e", "ne", "g", "ge", "l", "le", "o", "no", "p", "np",
               "s", "ns")  # fmt: skip
_JUMPS = frozenset(["jmp", *(f"j{c}" for c in _CONDITIONS)])
_PADS = frozenset(["nop", "endbr64", "endbr32"])


def lone_jump(word: int, code: bytes, addr: int) -> tuple[int, int] | None:
    """(address after, target) of the direct ``jmp`` that ``code`` (at ``addr``) starts with
    after no-ops and landing pads (``endbr64``); None when it starts otherwise."""
    for insn_addr, size, mnemonic, op_str in analyzer(word).disasm(code, addr):
        if mnemonic not in _PADS:
            target = _target(op_str) if mnemonic == "jmp" else None
            return None if target is None else (insn_addr + size, target)
    return None


def branches(word: int, code: bytes, addr: int) -> list[tuple[int, int | None]]:
    """(address after, target) of every jump in ``code`` (at ``addr``); target None: through
    a register or memory."""
    out: list[tuple[int, int | None]] = []
    for insn_addr, size, mnemonic, op_str in analyzer(word).disasm(code, addr):
        if mnemonic in _JUMPS:
            out.append((insn_addr + size, _target(op_str)))
    return out


def _target(op_str: str) -> int | None:
    """A direct jump's target as capstone prints it (hex, or decimal below 10); None for one
    through a register or memory."""
    try:
        return int(op_str, 16)
    except ValueError:
        return None
