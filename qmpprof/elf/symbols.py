"""SymbolTable: function symbols of one ELF, sorted once, looked up by address with bisect.

Symbols are kept with their sizes. An address inside a symbol names it; an address past the
end of every symbol names nothing unless the caller asks for ``lenient`` attribution (Redox's
``i`` mode: the nearest symbol below). A symbol of size 0 (hand-written assembly without
``.size``) is taken to extend up to the next symbol, since its real end is unknown.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

from qmpprof.elf.demangle import demangle_all


@dataclass(frozen=True, slots=True)
class Symbol:
    addr: int
    size: int
    name: str
    rank: int = 0  # lower wins when several symbols share an address (GLOBAL over WEAK/LOCAL)


class SymbolTable:
    """Sorted, de-duplicated symbols; ``lookup(addr)`` -> (name, offset) or None."""

    __slots__ = ("_names", "_starts", "_strict_ends")

    def __init__(self, symbols: Iterable[Symbol], *, demangle: bool = True) -> None:
        best: dict[int, Symbol] = {}
        for sym in symbols:
            old = best.get(sym.addr)
            if old is None or _better(sym, old):
                best[sym.addr] = sym
        ordered = sorted(best.values(), key=lambda s: s.addr)
        names = [s.name for s in ordered]
        self._names = demangle_all(names) if demangle else names
        self._starts = [s.addr for s in ordered]
        # Size-0 symbols reach the next symbol; everything else ends where its size says.
        nexts = [*self._starts[1:], 1 << 64][: len(ordered)]
        self._strict_ends = [
            s.addr + s.size if s.size else nxt for s, nxt in zip(ordered, nexts, strict=True)
        ]

    @classmethod
    def from_sorted(cls, starts: list[int], ends: list[int], names: list[str]) -> SymbolTable:
        """A table from parallel lists already sorted by start, one name per start, each with
        the end that a lookup must stay below: for sources of 10^5 symbols with no sizes
        (kallsyms), built without a Symbol per entry."""
        table = cls.__new__(cls)
        table._starts, table._strict_ends, table._names = starts, ends, names
        return table

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def starts(self) -> list[int]:
        """Every symbol's start, in address order (the table's own list: not to be changed)."""
        return self._starts

    def lookup(self, addr: int, *, lenient: bool = False) -> tuple[str, int] | None:
        """The symbol covering ``addr`` and the offset into it."""
        i = bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        if addr < self._strict_ends[i]:
            return self._names[i], addr - self._starts[i]
        # A larger symbol just below may still enclose addr (nested or overlapping symbols).
        for j in range(i - 1, max(i - 4, -1), -1):
            if addr < self._strict_ends[j]:
                return self._names[j], addr - self._starts[j]
        return (self._names[i], addr - self._starts[i]) if lenient else None

    def extent(self, addr: int) -> tuple[int, int] | None:
        """[start, end) of the symbol covering ``addr`` (as ``lookup`` finds it), or None."""
        hit = self.lookup(addr)
        if hit is None:
            return None
        i = bisect_right(self._starts, addr - hit[1]) - 1
        return self._starts[i], self._strict_ends[i]

    def address_of(self, name: str) -> int | None:
        """Start address of the first symbol with this (demangled) name."""
        for start, sym_name in zip(self._starts, self._names, strict=True):
            if sym_name == name:
                return start
        return None

    def columns(self) -> tuple[list[int], list[int], list[str]]:
        """Starts, strict ends and names, in address order: the table's own lists (not to be
        changed), for an index over 10^5 symbols built without a tuple per symbol."""
        return self._starts, self._strict_ends, self._names

    def items(self) -> list[tuple[int, int, str]]:
        """(start, strict end, name) triples in address order."""
        return list(zip(self._starts, self._strict_ends, self._names, strict=True))


def _better(new: Symbol, old: Symbol) -> bool:
    if new.rank != old.rank:
        return new.rank < old.rank
    if (new.size > 0) != (old.size > 0):
        return new.size > 0
    return len(new.name) < len(old.name)
