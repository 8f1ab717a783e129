"""Find and decode the kallsyms tables every Linux kernel carries, in a vmlinux with no .symtab.

``scripts/kallsyms`` writes these tables into ``.rodata``, each label aligned to 8 bytes:

- ``kallsyms_num_syms``: the symbol count (u32; a u64 in old kernels, whose low half is the same);
- ``kallsyms_names``: one entry per symbol, in address order: a length then that many token
  codes; the expanded text is nm's type letter followed by the name. From 6.1 a length of 0x80
  or more takes two bytes (ULEB128); before, such a byte was the length itself (names were
  shorter, so it almost never occurs): both readings are tried, the markers decide;
- ``kallsyms_markers``: u32 offsets into the names of every 256th entry;
- ``kallsyms_token_table``: 256 NUL-terminated strings, the expansion of each code (a code used
  as itself in some name expands to that one character);
- ``kallsyms_token_index``: 256 u16 offsets of those strings, ascending from 0;
- ``kallsyms_offsets``: one s32 per symbol, read in one of three ways. With
  ``kallsyms_relative_base`` (u64) and CONFIG_KALLSYMS_ABSOLUTE_PERCPU (x86_64 while its per-CPU
  area was zero-based, 6.12 included), a value >= 0 is an absolute per-CPU address and a
  negative one is ``base - 1 - value``; without absolute per-CPU symbols it is
  ``base + (u32)value``; from the 7.0 merge window there is no base, each value being relative
  to its own address. (Kernels built without CONFIG_KALLSYMS_BASE_RELATIVE, never the x86_64
  default, have u64 ``kallsyms_addresses`` instead: not read.)
- ``kallsyms_seqs_of_names`` (6.2 on, and Debian's 6.1): symbol indexes in name order, unused.

The order of the tables changed in 6.4: before, it is offsets, relative base, count, names,
markers, (seqs), tokens, token index; from 6.4 it is count, names, markers, tokens, token index,
offsets, relative base, seqs. So they are found by their shapes, never by fixed positions:

1. the token table, by the run ``"0\\0" "1\\0" ... "9\\0"`` (the digits are used as themselves
   in kernel names, so tokens 0x30-0x39 are the digits), then walking back to token 0 and
   checking that the token index right after the table lists exactly the string offsets;
2. the markers, an 8-aligned run of ascending u32 from 0 before the token table, at most one
   name-table stride apart;
3. the count and names, at the place before the markers where the count fits the number of
   markers and decoding that many entries meets every marker and ends at the markers;
4. the offsets and base, after the token index (new order) or before the count (old order):
   the placement whose addresses come out sorted wins.

Decoding 200 000 names takes one C-level ``codecs.charmap_decode`` per name, with the token
table as the character map.
"""

from __future__ import annotations

import codecs
import re
import struct
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError
from qmpprof.linux.symbols import KernelSymbols

_DIGITS = b"".join(bytes([c]) + b"\0" for c in b"0123456789")
_MAX_ENTRY = 2 + 512  # a two-byte length and KSYM_NAME_LEN codes
_KERNEL_SPACE = 0xFFFF800000000000
_U64 = (1 << 64) - 1
# Two markers: 0, then a first stride of 256 entries (512 bytes at least) that fits a u32 < 2**23.
# Zero-width, so that a match one byte early cannot hide the aligned one.
_MARKERS_START = re.compile(rb"(?=\x00{4}(?:.[\x02-\xff][\x00-\x7f]|..[\x01-\x7f])\x00)", re.DOTALL)
_WINDOW = 8 << 20  # how far before the token table the markers may be (seqs lie between)
_KNOWN_TEXT = ("start_kernel", "schedule")


@dataclass(frozen=True, slots=True)
class KallsymsLayout:
    """Where the tables are, as offsets into the searched bytes, and how offsets read."""

    count: int
    names: int
    markers: int
    token_table: int
    token_index: int
    offsets: int
    relative_base: int | None  # None: offsets are relative to their own address (7.0 on)
    absolute_percpu: bool
    wide_lengths: bool = True  # a names length >= 0x80 takes two bytes (6.1 on)


def read_kallsyms(image: ElfImage) -> KernelSymbols:
    """The kernel's symbols from the kallsyms tables in ``image``'s ``.rodata``."""
    rodata = image.section(".rodata")
    base = image.section_addr(".rodata")
    if rodata is None or base is None:
        raise KernelImageError(image.path, "no .rodata section, so no kallsyms tables")
    symbols = decode_kallsyms(rodata, base, image.path)
    for name in _KNOWN_TEXT:
        addr = symbols.address_of(name)
        if addr is None or not any(lo <= addr < hi for lo, hi in image.code_ranges()):
            raise KernelImageError(image.path, f"kallsyms tables found but {name} is not in code")
    return symbols


def decode_kallsyms(data: bytes, base_addr: int, path: str = "<kernel>") -> KernelSymbols:
    """Find the tables in ``data`` (loaded at ``base_addr``) and decode every symbol."""
    layout, addrs = _locate(data, base_addr, path)
    tokens = _tokens(data, layout.token_table)
    texts = _expand_names(data, layout, tokens)
    return KernelSymbols(addrs, [t[:1] for t in texts], [t[1:] for t in texts])


def locate_kallsyms(data: bytes, base_addr: int, path: str = "<kernel>") -> KallsymsLayout:
    """The layout of the kallsyms tables in ``data``; KernelImageError when there are none."""
    return _locate(data, base_addr, path)[0]


def _locate(data: bytes, base_addr: int, path: str) -> tuple[KallsymsLayout, list[int]]:
    scan = _Scan(data, base_addr)
    found = "token table"
    for table, index in scan.token_tables():
        found = "names and markers"
        for markers, count, names, wide in scan.names_before(table):
            found = "offsets"
            for offsets, base, percpu, addrs in scan.offset_placements(index, names, count):
                layout = KallsymsLayout(
                    count, names, markers, table, index, offsets, base, percpu, wide
                )
                return layout, addrs
    raise KernelImageError(path, f"no kallsyms tables in .rodata (no {found} found)")


class _Scan:
    """The searches over one ``.rodata``; positions are offsets into ``data``."""

    def __init__(self, data: bytes, base_addr: int) -> None:
        self.data = data
        self.base = base_addr

    def align(self, pos: int) -> int:
        return pos + (-(self.base + pos) & 7)

    def aligned(self, pos: int) -> bool:
        return (self.base + pos) & 7 == 0

    def u32(self, pos: int) -> int:
        value: int = struct.unpack_from("<I", self.data, pos)[0]
        return value

    def token_tables(self) -> Iterator[tuple[int, int]]:
        """(token table, token index) for every digit run that checks out."""
        data = self.data
        at = data.find(_DIGITS)
        while at >= 0:
            start = at
            for _ in range(0x30):  # back over tokens 0x2f .. 0x00, each non-empty
                start = data.rfind(b"\0", 0, start - 1) + 1
            offsets = _string_offsets(data, start)
            if offsets is not None and self.aligned(start):
                index = self.align(start + offsets[-1])
                if index + 512 <= len(data) and (
                    list(struct.unpack_from("<256H", data, index)) == offsets[:256]
                ):
                    yield start, index
            at = data.find(_DIGITS, at + 1)

    def names_before(self, table: int) -> Iterator[tuple[int, int, int, bool]]:
        """(markers, count, names, wide lengths) for marker runs before ``table``, nearest
        first. The window doubles from 64 KiB: the markers are usually right before the tokens."""
        high, span = table, 1 << 16
        while high > 0 and table - high < _WINDOW:
            low = max(0, high - span)
            # The lookahead may read up to 8 bytes past this window's end.
            found = _MARKERS_START.finditer(self.data, low, min(table, high + 8))
            starts = [m.start() for m in found if m.start() < high]
            for pos in reversed(starts):
                if not self.aligned(pos):
                    continue
                markers = self._ascending_run(pos, table)
                for k in range(len(markers), max(1, len(markers) - 3), -1):
                    for wide in (True, False):
                        hit = self._names_for(pos, markers[:k], wide)
                        if hit is not None:
                            yield pos, hit[0], hit[1], wide
            high, span = low, span * 2

    def _ascending_run(self, pos: int, end: int) -> list[int]:
        run = [0]
        at = pos + 4
        while at + 4 <= end:
            value = self.u32(at)
            if not 2 * 256 <= value - run[-1] <= _MAX_ENTRY * 256:
                break
            run.append(value)
            at += 4
        return run

    def _names_for(
        self, markers_pos: int, markers: list[int], wide: bool
    ) -> tuple[int, int] | None:
        """(count, names) whose entries meet ``markers`` and end just before them."""
        k = len(markers)
        last = markers[-1]
        high = markers_pos - last - 2
        low = max(8, markers_pos - last - 256 * _MAX_ENTRY)
        if high < low:
            return None
        start = self.align(low)
        number = (high - start) // 8 + 1
        # The u32 eight bytes before each aligned candidate: its count, if names start there.
        counts = _le32("I", self.data[start - 8 : start - 8 + 8 * number])[::2]
        for i in range(len(counts) - 1, -1, -1):
            count = counts[i]
            if not 256 * (k - 1) < count <= 256 * k:
                continue
            names = start + 8 * i
            # A quick look at the first stride, then every entry against every marker.
            if _skip_entries(self.data, names, 256, wide) != names + markers[1]:
                continue
            end = _walk_names(self.data, names, count, markers, wide)
            if markers_pos - 7 <= end <= markers_pos:
                return count, names
        return None

    def offset_placements(
        self, index: int, names: int, count: int
    ) -> Iterator[tuple[int, int | None, bool, list[int]]]:
        """(offsets, relative base, absolute per-CPU, addresses) for each placement of the
        offsets whose addresses come out sorted."""
        size = 4 * count
        new = self.align(index + 512)  # 6.4 on: offsets, then the base, after the token index
        old_base = names - 16  # before: offsets, base, count, names
        old = old_base - size
        old -= (self.base + old) & 7
        candidates: list[tuple[int, int | None]] = []
        new_base = self.align(new + size)
        if self._kernel_pointer(new_base):
            candidates.append((new, new_base))
        if old >= 0 and self._kernel_pointer(old_base):
            candidates.append((old, old_base))
        candidates.append((new, None))
        for offsets, base in candidates:
            if offsets + size > len(self.data):
                continue
            values = _le32("i", self.data[offsets : offsets + size])
            relative_base = None if base is None else self.u64(base)
            percpu = base is not None and min(values) < 0
            addrs = _addresses(values, self.base + offsets, relative_base, percpu)
            if addrs is not None:
                yield offsets, base, percpu, addrs

    def u64(self, pos: int) -> int:
        value: int = struct.unpack_from("<Q", self.data, pos)[0]
        return value

    def _kernel_pointer(self, pos: int) -> bool:
        return pos + 8 <= len(self.data) and self.u64(pos) >= _KERNEL_SPACE


def _le32(kind: str, data: bytes) -> array[int]:
    """Little-endian 32-bit integers (``kind`` "I" or "i"), whatever the host's order."""
    values = array(kind, data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _string_offsets(data: bytes, start: int) -> list[int] | None:
    """Offsets of 256 non-empty NUL-terminated strings from ``start``, plus their end."""
    offsets = []
    pos = start
    for _ in range(256):
        end = data.find(b"\0", pos)
        if end <= pos or end - pos > 64:
            return None
        offsets.append(pos - start)
        pos = end + 1
    offsets.append(pos - start)
    return offsets


def _entry_length(data: bytes, pos: int, wide: bool) -> tuple[int, int]:
    """(number of codes, where they start) of the names entry at ``pos``."""
    first = data[pos]
    if first < 0x80 or not wide:
        return first, pos + 1
    return (first & 0x7F) | (data[pos + 1] << 7), pos + 2


def _skip_entries(data: bytes, pos: int, count: int, wide: bool) -> int:
    """Where ``count`` names entries from ``pos`` end, or -1 when they run off the data."""
    limit = len(data) - 2
    for _ in range(count):
        if pos > limit:
            return -1
        length, pos = _entry_length(data, pos, wide)
        if length == 0:
            return -1
        pos += length
    return pos


def _walk_names(data: bytes, names: int, count: int, markers: list[int], wide: bool) -> int:
    """Where ``count`` entries from ``names`` end, or -1 when one of them misses its marker."""
    limit = 0x80 if wide else 0x100
    pos = names
    end = len(data) - 2
    for i in range(count):
        if (i & 0xFF == 0 and markers[i >> 8] != pos - names) or pos > end:
            return -1
        first = data[pos]
        pos += 1 + first if first < limit else 2 + ((first & 0x7F) | (data[pos + 1] << 7))
    return pos


def _tokens(data: bytes, table: int) -> tuple[str, ...]:
    out = []
    pos = table
    for _ in range(256):
        end = data.index(b"\0", pos)
        out.append(data[pos:end].decode("latin-1"))
        pos = end + 1
    return tuple(out)


def _expand_names(data: bytes, layout: KallsymsLayout, tokens: tuple[str, ...]) -> list[str]:
    decode = codecs.charmap_decode
    limit = 0x80 if layout.wide_lengths else 0x100
    out: list[str] = []
    pos = layout.names
    for _ in range(layout.count):
        first = data[pos]
        if first < limit:
            pos += 1
            length = first
        else:
            length = (first & 0x7F) | (data[pos + 1] << 7)
            pos += 2
        out.append(decode(data[pos : pos + length], "strict", tokens)[0])
        pos += length
    return out


def _addresses(
    values: array[int], offsets_addr: int, base: int | None, absolute_percpu: bool
) -> list[int] | None:
    """Every symbol's address from its offset, or None when they do not come out sorted."""
    if base is None:  # each offset is relative to its own address
        addrs = [(offsets_addr + 4 * i + v) & _U64 for i, v in enumerate(values)]
    elif absolute_percpu:
        addrs = [v if v >= 0 else base - 1 - v for v in values]
    else:
        addrs = [base + (v & 0xFFFFFFFF) for v in values]
    if any(a > b for a, b in pairwise(addrs)):
        return None
    return addrs
