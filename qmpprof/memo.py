"""Memo: the one bounded cache of qmpprof, a dict that starts over when it is full.

Per-pc caches (CFI rows, frames, modules) and per-address-space facts stay small in practice, but
a long run over a large kernel must not let them grow without end. Starting over is cheaper and
simpler than least-recently-used bookkeeping, and the entries are cheap to compute again.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_LIMIT = 1 << 16


class Memo(dict[K, V]):
    """A dict with ``put``, which forgets every entry once ``limit`` are held."""

    __slots__ = ("limit",)

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: K, value: V) -> V:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value
