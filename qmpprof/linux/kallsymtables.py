"""Where the kallsyms tables every Linux kernel carries are in its ``.rodata``, and how they read.

``scripts/kallsyms`` writes these tables into ``.rodata``, each label aligned to its ``ALGN``:

- ``kallsyms_num_syms``: the symbol count (u32; a u64 in old kernels, whose low half is the same);
- ``kallsyms_names``: one entry per symbol, in address order: a length then that many token
  codes, expanding to nm's type letter and the name. A length of 0x80 or more takes two bytes
  (ULEB128) from 6.1, one before: both readings are tried, the markers decide;
- ``kallsyms_markers``: u32 offsets into the names of every 256th entry;
- ``kallsyms_token_table``: 256 NUL-terminated strings, the expansion of each code (a code used
  as itself in some name expands to that one character), ``kallsyms_token_index`` their u16
  offsets;
- ``kallsyms_offsets``: one s32 per symbol. With ``kallsyms_relative_base`` (u64) and
  CONFIG_KALLSYMS_ABSOLUTE_PERCPU (x86_64 while its per-CPU area was zero-based, 6.12
  included) a value >= 0 is a per-CPU offset and a negative one ``base - 1 - value``; without
  absolute per-CPU symbols it is ``base + (u32)value``; in 7.x, with no base, it is relative
  to its own address. (u64 ``kallsyms_addresses``, without CONFIG_KALLSYMS_BASE_RELATIVE, are
  not read.)
- ``kallsyms_seqs_of_names`` (6.2 on, and Debian's 6.1): 3-byte symbol indexes in name order.

Neither order nor padding is fixed. Up to 6.3: offsets, base, count, names, markers, (seqs),
tokens, index; 6.4 to 6.x: count, names, markers, tokens, index, offsets, base, seqs, 8-aligned;
7.x: the same without the base, 4-aligned (so the names start 4 bytes after the count). So the
tables are found by their contents, any byte apart:

1. the token table, by the run ``"0\\0" "1\\0" ... "9\\0"`` (digits are used as themselves in
   names, so tokens 0x30-0x39 are the digits) and a walk back to token 1; its index is wherever
   the 512 bytes its string offsets make are (the two check each other, and say where token 0
   starts);
2. the markers, runs of ascending u32 from 0 a names stride apart, between and around the
   tokens in windows doubling outwards (one generated file holds all the tables);
3. the count, a u32 fitting the number of markers (nearest the markers first, then anywhere),
   and the names right after it, where walking that many entries meets every marker;
4. the offsets, next to a table found (or to the seqs of names or a relative base beside one),
   padded as the labels found are aligned (or to a smaller power of two): each placement and
   reading whose addresses come out sorted, in that order.

The search is bounded: a damaged image makes candidates of every kind abound (each digit run,
marker run, count and walk a dead end), so each step it takes is counted, and past
``SEARCH_STEPS`` it gives up with one line (Debian's undamaged kernels take a quarter at most).

A relative base is taken only where the tables themselves lie within the 4 GiB above it that
its 32-bit offsets reach (they are the kernel's data, named by its symbols).
``qmpprof.linux.kallsyms`` checks what is decoded against the rest of the image.
"""

from __future__ import annotations

import codecs
import operator
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import pairwise, repeat

from qmpprof.errors import KernelImageError
from qmpprof.linux.symbols import KernelSymbols

_DIGITS = b"".join(bytes([c]) + b"\0" for c in b"0123456789")
_MAX_ENTRY = 2 + 512  # a two-byte length and KSYM_NAME_LEN codes
_MAX_TOKEN = 512  # a token expands to a part of one name at most
_END = 1 << 64
# Two markers: 0, then a first stride of 256 entries (512 bytes at least) that fits a u32 < 2**23.
# Zero-width, so that a match one byte early cannot hide the real one.
_MARKERS_START = re.compile(rb"(?=\x00{4}(?:.[\x02-\xff][\x00-\x7f]|..[\x01-\x7f])\x00)", re.DOTALL)
_FIRST_WINDOW = 1 << 16
# Short ascending runs abound and each fits many counts: runs of 16 markers (4096 symbols) are
# looked for everywhere before shorter ones, and a kernel's tables are never shorter.
LONG_RUN = 16
_U32, _U64, _S32 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<i")
# A step is about one names entry walked in Python (a few hundred ns): 3 million is a second or
# so. Scans done in C count a step per 256 bytes searched (per 64 for the markers' regex).
SEARCH_STEPS = 3_000_000


class _Budget:
    """The steps the search has left; KernelImageError when they run out."""

    def __init__(self, path: str, steps: int) -> None:
        self.path = path
        self.steps = steps
        self.left = steps

    def spend(self, steps: int) -> None:
        self.left -= steps
        if self.left < 0:
            raise KernelImageError(
                self.path,
                f"no kallsyms tables in .rodata within {self.steps:,} steps of search "
                "(damaged tables: each candidate led nowhere)",
            )


@dataclass(frozen=True, slots=True)
class KallsymsLayout:
    """Where the tables are, as offsets into the searched bytes, and how offsets read."""

    count: int  # of symbols
    names: int
    markers: int
    token_table: int
    token_index: int
    offsets: int
    relative_base: int | None  # None: offsets are relative to their own address (7.x)
    absolute_percpu: bool
    wide_lengths: bool = True  # a names length >= 0x80 takes two bytes (6.1 on)
    num_syms: int = 0  # where the count is


@dataclass(frozen=True, slots=True)
class _Names:
    """The tables found before the offsets, and where each names entry starts."""

    layout: KallsymsLayout  # its offsets fields are not known yet
    starts: list[int]  # every entry's start, then the end of the last
    wide_at: list[int]  # the entries whose length takes two bytes
    spans: tuple[tuple[int, int], ...]  # (start, end) of each table found
    align: int  # the largest power of two (up to 4096) every label found is a multiple of


def decodings(
    data: bytes, base: int, path: str, markers: int = 2, steps: int = SEARCH_STEPS
) -> Iterator[tuple[KallsymsLayout, KernelSymbols]]:
    """Every decoding tables of ``markers`` markers or more allow, most likely first, found
    within ``steps``; at least one, or KernelImageError."""
    budget = _Budget(path, steps)
    stage = 0  # how far the search got: token table, names and markers, offsets, decoded
    for tokens in _token_tables(data, budget):
        stage = max(stage, 1)
        for names in _names(data, base, tokens, markers, budget):
            stage = max(stage, 2)
            table, table_end, _ = tokens
            words = tuple(data[table : table_end - 1].decode("latin-1").split("\0"))
            budget.spend(names.layout.count)
            texts = _expand(data, names, words)
            types = list(map(operator.itemgetter(slice(1)), texts))
            plain = list(map(operator.itemgetter(slice(1, None)), texts))
            for layout, addrs in _placements(data, base, names, budget):
                stage = 3
                budget.spend(names.layout.count)  # the symbols sorted and indexed
                yield layout, KernelSymbols(addrs, types, plain)
            if names.layout.count > 256 * (LONG_RUN - 1):
                break  # names meeting that many markers are the ones: only offsets may be wrong
    if stage < 3:
        missing = ("token table", "names and markers", "offsets")[stage]
        raise KernelImageError(path, f"no kallsyms tables in .rodata (no {missing} found)")


def _token_tables(data: bytes, budget: _Budget) -> Iterator[tuple[int, int, int]]:
    """(token table, its end, token index) for every digit run whose strings have an index."""
    at = data.find(_DIGITS)
    while at >= 0:
        budget.spend(0x2F + 3 * 256)  # its strings found, each a few steps
        second = at
        for _ in range(0x2F):  # back over tokens 0x2f .. 0x01, each non-empty
            second = data.rfind(b"\0", 0, second - 1) + 1
        rest = _string_offsets(data, second, 255)
        if rest is not None:
            yield from _token_index(data, second, rest, budget)
        at = data.find(_DIGITS, at + 1)


def _token_index(
    data: bytes, second: int, rest: list[int], budget: _Budget
) -> Iterator[tuple[int, int, int]]:
    """Where token 0 starts and the index is, given where tokens 1.. are. Token 0 reaches back
    to a NUL unless the table follows other bytes directly: the index, which gives its length,
    says where it starts (an index right after the table is read, elsewhere it is searched)."""
    end = second + rest[-1]
    earliest = data.rfind(b"\0", max(0, second - 2 - _MAX_TOKEN), second - 1) + 1
    for pos in range(end, min(end + 8, len(data) - 511)):
        index = struct.unpack_from("<256H", data, pos)
        start = second - index[1]
        if (
            index[0] == 0
            and earliest <= start < second - 1
            and all(a - index[1] == b for a, b in zip(index[1:], rest, strict=False))
        ):
            yield start, end, pos
            return
    for start in range(earliest, second - 1):
        offsets = [0, *(second - start + r for r in rest[:-1])]
        if offsets[-1] <= 0xFFFF:
            budget.spend(len(data) >> 8)
            found = data.find(struct.pack("<256H", *offsets))
            if found >= 0:
                yield start, end, found
                return


def _string_offsets(data: bytes, start: int, count: int) -> list[int] | None:
    """Offsets of ``count`` non-empty NUL-terminated strings from ``start``, plus their end."""
    offsets = []
    pos = start
    for _ in range(count):
        end = data.find(b"\0", pos, pos + _MAX_TOKEN + 1)
        if end <= pos:
            return None
        offsets.append(pos - start)
        pos = end + 1
    offsets.append(pos - start)
    return offsets


def _names(
    data: bytes, base: int, tokens: tuple[int, int, int], least: int, budget: _Budget
) -> Iterator[_Names]:
    """The count, names and markers (``least`` of them or more) that fit together, long
    marker runs first."""
    table, table_end, index = tokens
    runs = (
        (pos, run)
        for low, high in ((LONG_RUN, _END), (least, LONG_RUN))
        if low < high
        for pos, run in _marker_runs(data, min(table, index), max(table_end, index + 512), budget)
        if low <= len(run) < high
    )
    for markers_pos, run in runs:
        for k in range(len(run), max(1, len(run) - 3), -1):  # a run may go on past its end
            walks = _entries(data, markers_pos, run[:k], budget)
            for count_pos, names, wide, (starts, wide_at) in walks:
                spans = (
                    (index, index + 512),
                    (table, table_end),
                    (markers_pos, markers_pos + 4 * k),
                    (names, starts[-1]),
                    (count_pos, count_pos + 4),
                )
                labels = (base + pos for pos in (count_pos, names, markers_pos, table, index))
                align = min(4096, *(label & -label or 4096 for label in labels))
                layout = KallsymsLayout(
                    len(starts) - 1, names, markers_pos, table, index, 0, None, False, wide,
                    count_pos,
                )  # fmt: skip
                yield _Names(layout, starts, wide_at, spans, align)


def _marker_runs(
    data: bytes, low: int, high: int, budget: _Budget
) -> Iterator[tuple[int, list[int]]]:
    """(position, values) of ascending u32 runs from 0: between ``low`` and ``high``, then in
    windows doubling on both sides, the nearest first."""
    windows = [(low, high)]
    before, after, span = low, high, _FIRST_WINDOW
    while before > 0 or after < len(data):
        windows += [(max(0, before - span), before), (after, min(len(data), after + span))]
        before, after, span = max(0, before - span), min(len(data), after + span), span * 2
    for start, stop in windows:
        # The lookahead reads up to 8 bytes past a window's end.
        found = _MARKERS_START.finditer(data, start, min(len(data), stop + 8))
        budget.spend((stop - start) >> 6)
        hits = [m.start() for m in found if m.start() < stop]
        for pos in reversed(hits) if stop <= low else hits:
            run = _ascending_run(data, pos)
            budget.spend(len(run))
            yield pos, run


def _ascending_run(data: bytes, pos: int) -> list[int]:
    run = [0]
    at = pos + 4
    while at + 4 <= len(data):
        value = _U32.unpack_from(data, at)[0]
        if not 2 * 256 <= value - run[-1] <= _MAX_ENTRY * 256:
            break
        run.append(value)
        at += 4
    return run


def _entries(
    data: bytes, markers_pos: int, markers: list[int], budget: _Budget
) -> Iterator[tuple[int, int, bool, tuple[list[int], list[int]]]]:
    """(count position, names, wide lengths, walk) for each count fitting the markers whose
    names, right after it (a u32 and padding, or a u64), meet every marker."""
    k = len(markers)
    near = max(0, markers_pos - markers[-1] - 256 * _MAX_ENTRY - 16)
    seen: set[int] = set()
    for low, high in ((near, markers_pos), (0, len(data))):  # where names end at the markers
        budget.spend((high - low) >> 7)  # two patterns searched
        hits = [pos - 1 for pos in _find_all(data, struct.pack("<I", k - 1)[:3], low + 1, high)]
        hits += _find_all(data, struct.pack("<I", 256 * k), low, high)
        budget.spend(len(hits))
        for count_pos in sorted(set(hits) - seen, reverse=True):
            seen.add(count_pos)
            count = _U32.unpack_from(data, count_pos)[0]
            if not 256 * (k - 1) < count <= 256 * k:
                continue
            for names in range(count_pos + 4, count_pos + 12):
                walked = _walk(data, names, count, markers, True, budget)
                if walked is not None:
                    yield count_pos, names, True, walked
                if walked is None or walked[1]:  # with no long entry both readings are one
                    walked = _walk(data, names, count, markers, False, budget)
                    if walked is not None:
                        yield count_pos, names, False, walked


def _find_all(data: bytes, pattern: bytes, low: int, high: int) -> list[int]:
    """Where ``pattern`` starts in ``low`` .. ``high``."""
    out = []
    at = data.find(pattern, max(0, low), high + len(pattern))
    while at >= 0:
        out.append(at)
        at = data.find(pattern, at + 1, high + len(pattern))
    return out


def _walk(
    data: bytes, names: int, count: int, markers: list[int], wide: bool, budget: _Budget
) -> tuple[list[int], list[int]] | None:
    """Where each of ``count`` entries from ``names`` starts (then where the last ends) and
    which take a two-byte length; None when one misses its marker or leaves the data."""
    limit = 0x80 if wide else 0x100
    starts: list[int] = []
    add = starts.append
    wide_at: list[int] = []
    pos = names
    try:
        for k, marker in enumerate(markers):
            if pos - names != marker:
                return None
            budget.spend(256)
            for i in range(256 * k, min(count, 256 * k + 256)):
                add(pos)
                first = data[pos]
                if first < limit:
                    pos += 1 + first
                else:
                    wide_at.append(i)
                    pos += 2 + ((first & 0x7F) | (data[pos + 1] << 7))
    except IndexError:
        return None
    # The last entries meet no marker: at least none of them is empty.
    if len(starts) != count or pos > len(data) or not all(data[s] for s in starts[-256:]):
        return None
    add(pos)
    return starts, wide_at


def _expand(data: bytes, names: _Names, tokens: tuple[str, ...]) -> list[str]:
    decode = codecs.charmap_decode
    starts = names.starts
    texts = [decode(data[a + 1 : b], "strict", tokens)[0] for a, b in pairwise(starts)]
    for i in names.wide_at:
        texts[i] = decode(data[starts[i] + 2 : starts[i + 1]], "strict", tokens)[0]
    return texts


def _placements(
    data: bytes, base: int, names: _Names, budget: _Budget
) -> Iterator[tuple[KallsymsLayout, list[int]]]:
    """Each placement and reading of the offsets whose addresses come out sorted: 256 of
    them spread over the table first, then all."""
    size = 4 * names.layout.count
    seen: set[tuple[int, int | None]] = set()
    for pos, base_pos in _offset_spots(base, names):
        if (pos, base_pos) in seen or pos < 0 or pos + size > len(data):
            continue
        seen.add((pos, base_pos))
        relative_base = None
        if base_pos is not None:
            if not 0 <= base_pos <= len(data) - 8:
                continue
            relative_base = _U64.unpack_from(data, base_pos)[0]
            if not 0 <= base - relative_base < 1 << 32:
                continue  # a base is below the tables, which its 32-bit offsets reach
        budget.spend(names.layout.count >> 4)  # unpacked, and a sample of it sorted
        values = struct.unpack_from(f"<{size // 4}i", data, pos)
        step = max(1, len(values) // 256)
        for percpu in (True, False) if base_pos is not None else (False,):
            if _addresses(values[::step], base + pos, relative_base, percpu, step) is not None:
                budget.spend(names.layout.count)
                addrs = _addresses(values, base + pos, relative_base, percpu)
                if addrs is not None:
                    layout = replace(
                        names.layout, offsets=pos, relative_base=base_pos, absolute_percpu=percpu
                    )
                    yield layout, addrs


def _offset_spots(base: int, names: _Names) -> Iterator[tuple[int, int | None]]:
    """(offsets, relative base or None) next to the tables found: after one (or after the seqs
    of names after it, 3 or 4 bytes a symbol), the base after them or between; or before one
    (or before the seqs before it), the base before them or between. Padded as the labels
    found are aligned, or to a smaller power of two (they may all be aligned further by chance)."""
    size, align = 4 * names.layout.count, names.align

    def up(pos: int) -> int:
        return pos + (-(base + pos) % align)

    def down(pos: int) -> int:
        return pos - (base + pos) % align

    while align:
        for gap in (0, size * 3 // 4, size):
            for _, end in names.spans:
                pos = up(up(end) + gap)
                yield from ((pos, up(pos + size)), (up(pos + 8), pos), (pos, None))
            for start, _ in reversed(names.spans):
                stop = down(start - gap)
                pos, between = down(stop - size), down(stop - 8)
                yield from ((pos, down(pos - 8)), (down(between - size), between), (pos, None))
        align //= 2


def _addresses(
    values: tuple[int, ...], table_addr: int, base: int | None, percpu: bool, step: int = 1
) -> list[int] | None:
    """The addresses of every ``step``-th symbol from their offsets, or None when they do not
    come out sorted."""
    if base is None:  # each offset is relative to its own address
        addrs = list(map(operator.add, values, range(table_addr, _END, 4 * step)))
    elif percpu:  # the per-CPU symbols (>= 0) come first, then at least one other (< 0)
        split = next((i for i, value in enumerate(values) if value < 0), None)
        if split is None:
            return None
        addrs = [*values[:split], *map((base - 1).__sub__, values[split:])]
    else:
        addrs = list(map(base.__add__, map(operator.and_, values, repeat(0xFFFFFFFF))))
    return addrs if addrs == sorted(addrs) and addrs[0] >= 0 and addrs[-1] < _END else None
