"""Seeded damage for the fuzz test of the readers of untrusted bytes (test_fuzz_readers.py).

``Mutator`` damages bytes as files and memory get damaged: bits flipped, bytes and words set
to the values parsers trip on (0, all ones, the sign bit, the data's own length), runs copied
over others, bytes cut out or put in, the end cut off. ``GuestMemory`` is guest memory made of
pointers into itself, so that every list, tree and table walked through it meets loops,
unmapped pages and nonsense lengths; it counts what it is asked to read, and a walk that asks
for more than ``READ_LIMIT`` ranges is one that does not end. ``Cases`` runs the cases: it keeps
what escaped, what took too long or too much memory, and counts the cases that got past the
reader's first check (a fuzzer whose damage only ever meets that check tests nothing else).
A case's memory is the rise of the process's resident set at its peak: the kernel's high-water
mark (VmHWM), reset before each case by writing 5 to /proc/self/clear_refs (proc(5), Linux 4.0
and later): two small file operations a case, where tracing each allocation (tracemalloc) made
these cases two to eight times slower.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from protowire import fields, varint

from qmpprof.errors import QmpprofError

SEED_VARIABLE = "QMPPROF_FUZZ_SEED"
SEED = int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(1 << 32))
CPU_LIMIT = 2.0  # seconds of CPU a case of a reader may take (``Cases(limits=True)``)
MEMORY_LIMIT = (
    128 << 20
)  # bytes a case's resident set may rise at its peak (``Cases(memory=True)``)
READ_LIMIT = 200_000  # ranges one walk may ask for: the walks' own bounds are far below
_WORDS = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFF_FFFF, 0xFFFF_FFFF, 1 << 31)


def seed() -> int:
    """The run's seed: $QMPPROF_FUZZ_SEED when set (to run a failure again), else a new one."""
    return SEED


class Cases:
    """Runs cases, keeps the first few escapes, says the seed in every failure. A case that
    returns, or raises an error whose message holds none of ``first_check``, got past the
    reader's first check (``deep``). With ``limits``, each case's CPU time is measured against
    CPU_LIMIT; with ``memory`` too, the rise of its resident set at its peak against
    MEMORY_LIMIT (C allocations, zlib's and the codecs', counted as well as Python's)."""

    def __init__(
        self,
        name: str,
        first_check: tuple[str, ...] = (),
        limits: bool = False,
        memory: bool = False,
    ) -> None:
        self.rng = random.Random(f"{SEED}:{name}")
        self.mutator = Mutator(self.rng)
        self.first_check = first_check
        self.limits = limits
        self.memory = memory
        self.count = 0
        self.deep = 0
        self.escapes: list[str] = []
        self.over: list[str] = []  # cases over a limit

    def run(self, case: Callable[[], object], allowed: tuple[type[Exception], ...] = ()) -> None:
        self.count += 1
        resident = _reset_peak() if self.memory else 0
        started = time.process_time()
        try:
            case()
            self.deep += 1
        except (QmpprofError, *allowed) as err:
            self.deep += not any(part in str(err) for part in self.first_check)
        except Exception as err:  # what the test is for: anything else escaping a reader
            if len(self.escapes) < 5:
                self.escapes.append(f"case {self.count}: {type(err).__name__}: {err}")
        finally:
            cpu = time.process_time() - started
            peak = _memory()["VmHWM"] - resident if self.memory else 0
            if self.limits:
                self._measure(cpu, peak)

    def _measure(self, cpu: float, peak: int) -> None:
        if cpu > CPU_LIMIT or peak > MEMORY_LIMIT:
            self.over.append(f"case {self.count}: {cpu:.2f} s of CPU, {peak >> 20} MiB")

    def verdict(self, at_least: int, deep: int = 0) -> None:
        """At least ``at_least`` cases, ``deep`` of them past the first check; none escaped
        and none over a limit."""
        print(f"fuzz seed {SEED}: {self.count} cases, {self.deep} past the first check")
        assert self.count >= at_least
        assert self.deep >= deep, f"seed {SEED}: {self.deep} of {self.count} past the first check"
        assert not self.escapes, f"seed {SEED} ({SEED_VARIABLE}={SEED}): {self.escapes}"
        assert not self.over, f"seed {SEED} ({SEED_VARIABLE}={SEED}): {self.over[:5]}"


def _memory() -> dict[str, int]:
    """The process's resident set now (VmRSS) and at its peak (VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        found = re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", status.read(), re.M)
    return {name: int(size) << 10 for name, size in found}


def _reset_peak() -> int:
    """The peak set back to the resident set now; that size."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _memory()["VmRSS"]


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
        return self._pointer(self.rng.getrandbits(64))

    def _pointer(self, bits: int) -> int:
        """``pointer`` drawn from 64 random bits (each choice from bits of its own)."""
        page = self.pages[bits % len(self.pages)]
        kind, bits = (bits >> 8) % 6, bits >> 16
        if kind < 2:
            return page + (bits & 0xF) * 256 | (bits >> 4 & 3) << 3 | 2
        odd = (bits >> 9) % 7 + 1 if kind == 5 else 0
        return page + (bits & 0x1FF) * 8 | odd

    def _page(self, page: int) -> bytes | None:
        """A page of words: two in three a pointer, else 0 (half of these), a number below 64
        or any word. Drawn in one call of the generator: a page is 512 words, and a walk of
        loops reads thousands of pages."""
        if page not in self._memory:
            rng = self.rng
            if rng.randrange(10) == 0:
                self._memory[page] = None
            else:
                count = self.PAGE // 8
                draws = struct.unpack(f"<{2 * count}Q", rng.randbytes(16 * count))
                words = [
                    self._pointer(choice >> 8)
                    if choice % 3
                    else (0, 0, value % 64, value)[choice >> 2 & 3]
                    for choice, value in zip(draws[::2], draws[1::2], strict=True)
                ]
                self._memory[page] = struct.pack(f"<{count}Q", *words)
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


# Values the readers of JSON and TOML trip on: out of range, of the wrong type, not finite, a
# lone surrogate (JSON escapes one as \ud800), long.
ODD_VALUES: tuple[object, ...] = (
    None, True, -1, 0, 0.5, 1 << 16, 1 << 63, 1 << 64, -(1 << 63) - 1, 10**400, 1e308,
    float("inf"), float("nan"), "", "\ud800", "a\udfffb", "0x" + "f" * 17, "x" * 70_000, [], {},
    [[[[]]]], {"a": 1},
)  # fmt: skip


def mutate_json(rng: random.Random, doc: object, edits: int = 3) -> object:
    """A copy of the JSON value ``doc`` with 1 to ``edits`` of its values replaced by odd ones,
    lists shortened or an element repeated."""
    out = json.loads(json.dumps(doc))
    for _ in range(rng.randint(1, edits)):
        parent: list[Any] | dict[str, Any] = out
        while True:
            keys: list[Any] = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
            if not keys:
                break
            key = rng.choice(keys)
            child = parent[key]
            if isinstance(child, list | dict) and child and rng.randrange(4):
                parent = child
                continue
            choice = rng.randrange(6)
            if choice == 0 and isinstance(parent, list):
                del parent[key]
            elif choice == 1 and isinstance(parent, list):
                parent.insert(key, copy.deepcopy(parent[key]))
            else:
                parent[key] = copy.deepcopy(rng.choice(ODD_VALUES))
            break
    return out


def nested(depth: int) -> str:
    """A JSON (and TOML) value nested ``depth`` deep."""
    return "[" * depth + "]" * depth


# profile.proto's fields that are messages, by the message holding them: the profile's sample
# types, samples, mappings, locations, functions and period type; a sample's labels; a
# location's lines. A sample's location ids (1) and values (2) are packed integers.
_MESSAGES = {0: (1, 2, 3, 4, 5, 11), 2: (3,), 4: (4,)}
_ODD_INTS = (
    0,
    1,
    2,
    0x7F,
    0xFFFF,
    0x10000,
    1 << 31,
    1 << 32,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
)
_ODD_BYTES = (
    b"",
    b"\xed\xa0\x80",
    b"\xff\xfe",
    b"x" * 4096,
    b"[unknown] [",
    b"a (pid 99999999999)",
)
Field = list[Any]  # [number, wire type, value: int, bytes or a list of Fields]


def mutate_proto(rng: random.Random, data: bytes, edits: int = 3) -> bytes:
    """A protobuf message (profile.proto) with 1 to ``edits`` of its fields, at any depth,
    given odd values, dropped or repeated, and encoded again."""
    tree = _fields(data, 0)
    for _ in range(rng.randint(1, edits)):
        _edit(rng, tree, 0)
    return _encode(tree)


def _fields(data: bytes, holder: int) -> list[Field]:
    out: list[Field] = []
    for number, wire, value in fields(data):
        if isinstance(value, bytes) and number in _MESSAGES.get(holder, ()):
            out.append([number, wire, _fields(value, number if holder == 0 else -1)])
        else:
            out.append([number, wire, value])
    return out


def _edit(rng: random.Random, tree: list[Field], holder: int) -> None:
    if not tree:
        return
    at = rng.randrange(len(tree))
    number, wire, value = tree[at]
    choice = rng.randrange(8)
    if choice == 0:
        del tree[at]
    elif choice == 1:
        tree.insert(at, copy.deepcopy(tree[at]))
    elif isinstance(value, list):
        _edit(rng, value, number if holder == 0 else -1)
    elif isinstance(value, int):
        tree[at][2] = rng.choice((*_ODD_INTS, rng.getrandbits(64)))
        tree[at][2] &= (1 << (64 if wire != 5 else 32)) - 1
    elif holder == 2 and number in (1, 2):
        odd = [rng.choice((*_ODD_INTS, rng.randrange(8))) for _ in range(rng.randint(1, 4))]
        tree[at][2] = b"".join(map(varint, odd))
    else:
        tree[at][2] = rng.choice((*_ODD_BYTES, rng.randbytes(8)))


def _encode(tree: list[Field]) -> bytes:
    out = bytearray()
    for number, wire, value in tree:
        out += varint(number << 3 | wire)
        if wire == 0:
            out += varint(value)
        elif wire == 2:
            inner = _encode(value) if isinstance(value, list) else value
            out += varint(len(inner)) + inner
        else:
            out += value.to_bytes(8 if wire == 1 else 4, "little")
    return bytes(out)
