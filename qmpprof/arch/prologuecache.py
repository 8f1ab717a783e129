"""An instruction set's prologue analysis with one answer per (code, code address, pc,
function start and end) kept. The code itself is part of the key: programs linked at the same
address (every static user program at 0x401000) must not share answers; bytes cache their
hash."""

from __future__ import annotations

from collections.abc import Callable

from qmpprof.arch.base import PrologueRule
from qmpprof.memo import Memo

LIMIT = 1 << 14  # answers kept
Analyze = Callable[[bytes, int, int, "int | None", "int | None"], "PrologueRule | None"]


class CachedAnalysis:
    """``analyze`` as the instruction set's prologue analysis, its answers cached."""

    def __init__(self, analyze: Analyze) -> None:
        self._analyze = analyze
        self._cache: Memo[tuple[bytes, int, int, int | None, int | None], PrologueRule | None] = (
            Memo(LIMIT)
        )

    def analyze(
        self,
        code: bytes,
        code_addr: int,
        pc: int,
        func_start: int | None,
        func_end: int | None = None,
    ) -> PrologueRule | None:
        """How to find the caller at link address ``pc`` inside ``code`` (which starts at
        ``code_addr``); ``func_start`` and ``func_end`` come from the symbol table. None: frame
        records."""
        key = (code, code_addr, pc, func_start, func_end)
        try:
            return self._cache[key]
        except KeyError:
            found = self._analyze(code, code_addr, pc, func_start, func_end)
            return self._cache.put(key, found)
