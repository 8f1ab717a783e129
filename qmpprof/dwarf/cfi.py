"""CfiTable: the call-frame information of one ELF (.eh_frame or .debug_frame), searchable by pc.

Parsing is lazy. ``parse`` only keeps the bytes; the first lookup builds a sorted FDE index
(from the binary-search table of .eh_frame_hdr when given, else by walking the records once),
an FDE's rows are compiled the first time one of its pcs is asked for, and every answer is
cached per pc. The bytes may come from a file or from guest memory (``section_addr`` is where
they live, needed for pc-relative pointers). ``address_size`` is the target's (8 on x86_64, 4 on
i386: ``qmpprof.dwarf.arch``). Malformed records never raise: their pcs get None.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from dataclasses import dataclass
from typing import Literal

from qmpprof.dwarf.encoding import (
    PE_ABSPTR,
    PE_DATAREL,
    PE_OMIT,
    PE_SDATA4,
    CfiDecodeError,
    Reader,
    pointer_size,
)
from qmpprof.dwarf.program import Cie, Kind, RegRule, Rule, compile_rows
from qmpprof.memo import Memo

__all__ = ["CfiTable", "Fde", "Kind", "RegRule", "Rule"]

FrameKind = Literal["eh_frame", "debug_frame"]


@dataclass(frozen=True, slots=True)
class Fde:
    """One FDE: link addresses [pc_begin, pc_end), record at ``offset`` in the section."""

    offset: int
    cie_offset: int
    pc_begin: int
    pc_end: int
    insn_start: int
    insn_end: int


class CfiTable:
    """Rows of the CFI table of one ELF, looked up by link-time pc."""

    def __init__(
        self,
        data: bytes,
        section_addr: int,
        kind: FrameKind,
        hdr: bytes | None,
        hdr_addr: int,
        address_size: int = 8,
    ) -> None:
        self.data = data
        self.section_addr = section_addr
        self.kind: FrameKind = kind
        self.address_size = address_size
        self._hdr = hdr
        self._hdr_addr = hdr_addr
        self._starts: list[int] | None = None
        self._offsets: list[int] = []
        self._cies: dict[int, Cie | None] = {}
        self._decoded: dict[int, Fde | None] = {}
        self._fdes: dict[int, tuple[Fde, list[int], list[Rule]] | None] = {}
        self._pc_cache: Memo[int, Rule | None] = Memo()

    @classmethod
    def parse(
        cls,
        data: bytes,
        section_addr: int,
        *,
        kind: FrameKind = "eh_frame",
        hdr: bytes | None = None,
        hdr_addr: int = 0,
        address_size: int = 8,
    ) -> CfiTable:
        if address_size not in (4, 8):
            raise ValueError(f"address size {address_size}: 4 or 8")
        return cls(bytes(data), section_addr, kind, hdr, hdr_addr, address_size)

    def row_for(self, pc: int) -> Rule | None:
        """The compiled row covering link address ``pc``, or None when no FDE describes it."""
        try:
            return self._pc_cache[pc]
        except KeyError:
            pass
        return self._pc_cache.put(pc, self._lookup(pc))

    def fdes(self) -> list[Fde]:
        """Every decodable FDE in pc order (for tests, tools and the readelf comparison)."""
        self._index()
        out = []
        for offset in self._offsets:
            entry = self._fde_rows(offset)
            if entry is not None:
                out.append(entry[0])
        return out

    def rows(self, fde: Fde) -> list[Rule]:
        entry = self._fde_rows(fde.offset)
        return [] if entry is None else entry[2]

    def _lookup(self, pc: int) -> Rule | None:
        starts = self._index()
        i = bisect_right(starts, pc) - 1
        # FDEs may overlap (empty or discarded ones share a start): try the few nearest.
        for j in range(i, max(i - 3, -1), -1):
            fde = self._fde(self._offsets[j])
            if fde is None or not fde.pc_begin <= pc < fde.pc_end:
                continue
            entry = self._fdes.get(fde.offset)
            if entry is not None:  # compiled whole already (``rows``)
                _, row_starts, rules = entry
                k = bisect_right(row_starts, pc) - 1
                return rules[k] if k >= 0 and pc < rules[k].end else None
            # The row at pc alone: a lookup in a pause builds one row, not the FDE's every row
            # (~300 us for a riscv64 6.12 kernel function's ~15 on this project's host).
            (row,) = self._compile(fde, pc) or (None,)
            return row if row is not None and row.start <= pc < row.end else None
        return None

    def prepare(self) -> None:
        """Build the FDE index now (it is built on the first lookup otherwise): a run calls
        this before it first stops the guest, so that the first pause is not the slow one."""
        self._index()

    def _index(self) -> list[int]:
        if self._starts is None:
            pairs = self._hdr_index() if self._hdr is not None else None
            if pairs is None:
                pairs = self._scan_index()
            pairs.sort()
            self._starts = [p[0] for p in pairs]
            self._offsets = [p[1] for p in pairs]
        return self._starts

    def _hdr_index(self) -> list[tuple[int, int]] | None:
        """(initial location, FDE offset) pairs from .eh_frame_hdr, or None if unusable."""
        assert self._hdr is not None
        try:
            r = Reader(self._hdr, 0, self._hdr_addr, self.address_size)
            if r.u8() != 1:
                return None
            ptr_enc, count_enc, table_enc = r.u8(), r.u8(), r.u8()
            r.pointer(ptr_enc, self._hdr_addr)
            if count_enc == PE_OMIT or table_enc == PE_OMIT:
                return None
            count = r.pointer(count_enc, self._hdr_addr)
            size = pointer_size(table_enc, self.address_size)
            if size == 0 or r.pos + 2 * size * count > len(self._hdr):
                return None
            if table_enc == PE_DATAREL | PE_SDATA4:  # what every GNU linker writes: one unpack
                flat = struct.unpack_from(f"<{2 * count}i", self._hdr, r.pos)
                mask = (1 << (8 * self.address_size)) - 1
                locs = [(v + self._hdr_addr) & mask for v in flat]
            else:
                locs = [r.pointer(table_enc, self._hdr_addr) for _ in range(2 * count)]
        except CfiDecodeError:
            return None
        end = self.section_addr + len(self.data)
        pairs = list(zip(locs[0::2], locs[1::2], strict=True))
        if any(not self.section_addr <= addr < end for _, addr in pairs):
            return None
        return [(loc, addr - self.section_addr) for loc, addr in pairs]

    def _scan_index(self) -> list[tuple[int, int]]:
        pairs: list[tuple[int, int]] = []
        pos = 0
        while pos + 4 <= len(self.data):
            try:
                header = self._record(pos)
            except CfiDecodeError:
                break
            if header is None:
                break
            end, cie_offset = header
            if cie_offset is not None:
                try:
                    fde = self._decode_fde(pos)
                except CfiDecodeError:
                    fde = None
                if fde is not None:
                    pairs.append((fde.pc_begin, pos))
            pos = end
        return pairs

    def _record(self, pos: int) -> tuple[int, int | None] | None:
        """(end of record, CIE offset or None for a CIE) for the record at ``pos``; None = end."""
        r = Reader(self.data, pos, self.section_addr, self.address_size)
        length = r.u32()
        wide = length == 0xFFFFFFFF
        if wide:
            length = r.u64()
        if length == 0:
            return None  # the .eh_frame terminator
        end = r.pos + length
        if end > len(self.data):
            raise CfiDecodeError(f"record at {pos:#x} runs past the section")
        id_pos = r.pos
        ident = r.u64() if wide else r.u32()
        if self.kind == "eh_frame":
            return end, (None if ident == 0 else id_pos - ident)
        cie_id = 0xFFFFFFFFFFFFFFFF if wide else 0xFFFFFFFF
        return end, (None if ident == cie_id else ident)

    def _cie(self, pos: int) -> Cie | None:
        if pos not in self._cies:
            try:
                self._cies[pos] = self._decode_cie(pos)
            except CfiDecodeError:
                self._cies[pos] = None
        return self._cies[pos]

    def _decode_cie(self, pos: int) -> Cie | None:
        header = self._record(pos)
        if header is None or header[1] is not None:
            return None
        end = header[0]
        r = Reader(self.data, pos, self.section_addr, self.address_size)
        wide = r.u32() == 0xFFFFFFFF
        r.pos += 16 if wide else 4  # skip the 64-bit length and id, or the 32-bit id
        version = r.u8()
        aug = r.cstring()
        if version == 4 and r.u8() != self.address_size:  # address_size
            return None
        if version == 4:
            r.u8()  # segment_selector_size
        code_align, data_align = r.uleb(), r.sleb()
        ra = r.u8() if version == 1 else r.uleb()
        fde_enc, signal = PE_ABSPTR, False
        if aug.startswith(b"z"):
            aug_end = r.uleb()
            aug_end += r.pos
            for ch in aug[1:]:
                if ch == ord("R"):
                    fde_enc = r.u8()
                elif ch == ord("L"):
                    r.u8()
                elif ch == ord("P"):
                    r.pointer(r.u8())
                elif ch == ord("S"):
                    signal = True
            r.pos = aug_end
        elif aug not in (b"", b"S"):
            return None  # an augmentation we cannot skip safely
        signal = signal or aug == b"S"
        return Cie(
            code_align, data_align, ra, fde_enc, aug.startswith(b"z"), signal, r.pos, end,
            self.address_size,
        )  # fmt: skip

    def _decode_fde(self, pos: int) -> Fde | None:
        header = self._record(pos)
        if header is None or header[1] is None:
            return None
        end, cie_offset = header[0], header[1]
        cie = self._cie(cie_offset)
        if cie is None:
            return None
        r = Reader(self.data, pos, self.section_addr, self.address_size)
        wide = r.u32() == 0xFFFFFFFF
        r.pos += 16 if wide else 4  # skip the 64-bit length and id, or the 32-bit id
        pc_begin = r.pointer(cie.fde_enc)
        pc_range = r.pointer(cie.fde_enc & 0x0F)
        if cie.augmented:
            r.pos += r.uleb()
        if r.pos > end:
            return None
        return Fde(pos, cie_offset, pc_begin, pc_begin + pc_range, r.pos, end)

    def _fde_rows(self, offset: int) -> tuple[Fde, list[int], list[Rule]] | None:
        if offset in self._fdes:
            return self._fdes[offset]
        fde = self._fde(offset)
        entry = None
        if fde is not None:
            rules = self._compile(fde)
            entry = (fde, [rule.start for rule in rules], rules)
        self._fdes[offset] = entry
        return entry

    def _fde(self, offset: int) -> Fde | None:
        """The FDE at ``offset``, decoded once (None: not decodable)."""
        if offset in self._decoded:
            return self._decoded[offset]
        try:
            fde = self._decode_fde(offset)
        except CfiDecodeError:
            fde = None
        self._decoded[offset] = fde
        return fde

    def _compile(self, fde: Fde, until: int | None = None) -> list[Rule]:
        cie = self._cie(fde.cie_offset)
        assert cie is not None  # _decode_fde checked it
        return compile_rows(
            self.data, self.section_addr, cie,
            (fde.insn_start, fde.insn_end), (fde.pc_begin, fde.pc_end), until,
        )  # fmt: skip
