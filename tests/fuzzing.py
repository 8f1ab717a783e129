"""Seeded damage for the fuzz test of the readers of untrusted bytes (test_fuzz_readers.py).

``Mutator`` damages bytes as files and memory get damaged: bits flipped, bytes and words set
to the values parsers trip on (0, all ones, the sign bit, the data's own length), runs copied
over others, bytes cut out or put in, the end cut off. ``GuestMemory`` is guest memory made of
pointers into itself, so that every list, tree and table walked through it meets loops,
unmapped pages and nonsense lengths; it counts what it is asked to read, and a walk that asks
for more than ``READ_LIMIT`` ranges is one that does not end.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

SEED_VARIABLE = "QMPPROF_FUZZ_SEED"
READ_LIMIT = 200_000  # ranges one walk may ask for: the walks' own bounds are far below
_WORDS = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFF_FFFF, 0xFFFF_FFFF, 1 << 31)


def seed() -> int:
    """The run's seed: $QMPPROF_FUZZ_SEED when set (to run a failure again), else a new one."""
    given = os.environ.get(SEED_VARIABLE)
    return int(given) if given else random.SystemRandom().randrange(1 << 32)


class Mutator:
    """Damage of bytes, drawn from one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def mutate(self, data: bytes, span: tuple[int, int] | None = None, edits: int = 4) -> bytes:
        """``data`` with 1 to ``edits`` damages inside ``span`` (start, end; all of it by
        default); one case in eight also loses its end or gains or loses bytes."""
        rng = self.rng
        out = bytearray(data)
        start, end = span or (0, len(out))
        end = min(end, len(out))
        for _ in range(rng.randint(1, edits)):
            if end - start < 8:
                break
            at = rng.randrange(start, end - 8)
            choice = rng.randrange(5)
            if choice == 0:
                out[at] ^= 1 << rng.randrange(8)
            elif choice == 1:
                out[at] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
            elif choice == 2:
                width = rng.choice((2, 4, 8))
                value = rng.choice((*_WORDS, len(data), rng.getrandbits(8 * width)))
                out[at : at + width] = (value & ((1 << 8 * width) - 1)).to_bytes(width, "little")
            elif choice == 3:
                size = rng.randint(1, min(64, end - start))
                source = rng.randrange(start, end - size + 1)
                out[at : at + size] = out[source : source + size]
                del out[len(data) :]
            else:
                out[at : at + 4] = rng.randbytes(4)
        if rng.randrange(8) == 0:
            at = rng.randrange(start, max(start + 1, end))
            kind = rng.randrange(3)
            if kind == 0:
                del out[at:]
            elif kind == 1:
                del out[at : at + rng.randint(1, 16)]
            else:
                out[at:at] = rng.randbytes(rng.randint(1, 16))
        return bytes(out)


class WalkTooLong(Exception):
    """A walk of guest memory asked for more than READ_LIMIT ranges: it does not end."""


class GuestMemory:
    """Guest memory of random pages whose words are mostly pointers into a few of its own
    pages (lists that loop, trees that hold themselves), zeros and small numbers; one page in
    ten is not mapped. Pages are made when first read, from the seed."""

    PAGE = 4096

    def __init__(self, rng: random.Random, bases: Sequence[int], pages: int = 24) -> None:
        self.rng = rng
        self.pages = [base + self.PAGE * rng.randrange(pages) for base in bases for _ in range(6)]
        self._memory: dict[int, bytes | None] = {}
        self.reads = 0

    def pointer(self) -> int:
        """An address inside one of the pages: 8-aligned, or one time in three a maple tree
        node's (256-aligned, its type in bits 3 to 6 and 2 in the low bits), or odd."""
        rng = self.rng
        page = rng.choice(self.pages)
        kind = rng.randrange(6)
        if kind < 2:
            return page + rng.randrange(0, self.PAGE, 256) | rng.randrange(4) << 3 | 2
        return page + rng.randrange(0, self.PAGE, 8) | (rng.randrange(1, 8) if kind == 5 else 0)

    def _page(self, page: int) -> bytes | None:
        if page not in self._memory:
            rng = self.rng
            if rng.randrange(10) == 0:
                self._memory[page] = None
            else:
                words = [
                    rng.choice((0, 0, rng.randrange(64), rng.getrandbits(64)))
                    if rng.randrange(3) == 0
                    else self.pointer()
                    for _ in range(self.PAGE // 8)
                ]
                self._memory[page] = b"".join(w.to_bytes(8, "little") for w in words)
        return self._memory[page]

    def read_range(self, addr: int, size: int) -> bytes | None:
        if size > 64 << 20 or addr < 0 or addr + size > 1 << 64:
            return None  # what a transport refuses as well
        out = bytearray()
        first = addr - addr % self.PAGE
        for page in range(first, addr + size, self.PAGE):
            found = self._page(page)
            if found is None:
                return None
            out += found
        return bytes(out[addr - first : addr - first + size])

    async def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        self.reads += len(ranges)
        if self.reads > READ_LIMIT:
            raise WalkTooLong(f"more than {READ_LIMIT} ranges read")
        return [self.read_range(addr, size) for addr, size in ranges]
