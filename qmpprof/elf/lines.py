"""Source positions for --lines: file:line of a pc and the chain of functions inlined there.

Reads DWARF (.debug_line, .debug_info) lazily: nothing is parsed until the first lookup, a
compilation unit's line table and DIE tree are decoded the first time one of its pcs is asked
for, and every answer is cached per pc. pyelftools finds the units and reads the headers; the
line programs' opcodes are run by ``qmpprof.dwarf.lineprogram``, ten times faster, and the
scopes around a pc are found by ``qmpprof.dwarf.dies``' walk over the unit's bytes (with
pyelftools' DIEs where that walk cannot read them). Broken or missing DWARF gives empty
answers, never an exception: line numbers are a nicety, the profile must still come out.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qmpprof.dwarf.dies import TAG_INLINED_SUBROUTINE, UnitShape, UnitWalk, abbrevs_at
from qmpprof.dwarf.encoding import CfiDecodeError
from qmpprof.dwarf.lineprogram import LineHeader, Row, line_rows
from qmpprof.memo import Memo

_CACHE_LIMIT = 1 << 15


@dataclass(frozen=True, slots=True)
class SourceFrame:
    """One logical frame at a pc: ``function`` is None for the outermost (real) function, whose
    name comes from the symbol table; inlined callees carry their DWARF name."""

    function: str | None
    file: str | None
    line: int | None


class _Unit:
    """The line table of one compilation unit and the walk over its DIEs (None where the walk
    cannot read its abbreviations)."""

    def __init__(self, dwarf: Any, cu: Any, abbrev_data: bytes) -> None:
        shape = UnitShape(cu["version"], 8 if cu.dwarf_format() == 64 else 4, cu["address_size"])
        self.walk: UnitWalk | None = None
        try:
            abbrevs = abbrevs_at(abbrev_data, cu["debug_abbrev_offset"], shape)
            info = _read(dwarf.debug_info_sec.stream, cu.cu_offset, cu.size)
            self.walk = UnitWalk(info, abbrevs, shape)
        except CfiDecodeError:  # forms the walk does not know: pyelftools' DIEs instead
            pass
        self.files: list[str] = []
        self.file_base = 1
        self.rows: list[Row] = []
        self.starts: list[int] = []
        program = dwarf.line_program_for_CU(cu)
        if program is None:
            return
        base = 0 if program.header.version >= 5 else 1  # DWARF 5 numbers files from 0
        self.files = [entry.name.decode("utf-8", "replace") for entry in program["file_entry"]]
        self.file_base = base
        self.rows = line_rows(_program_code(program), _header(program, cu))
        self.rows.sort(key=lambda row: row[0])
        self.starts = [row[0] for row in self.rows]

    def file(self, index: int) -> str | None:
        i = index - self.file_base
        return self.files[i] if 0 <= i < len(self.files) else None

    def line_at(self, pc: int) -> tuple[str | None, int | None]:
        i = bisect_right(self.starts, pc) - 1
        if i < 0 or self.rows[i][2] == 0:
            return None, None
        _addr, file_index, line = self.rows[i]
        return self.file(file_index), line


class LineTable:
    """``frames(pc)``: the source frames at a link address, innermost first."""

    def __init__(self, open_dwarf: Callable[[], Any]) -> None:
        # pyelftools stays in image.py: it hands over a function giving its DWARFInfo (or None).
        self._open_dwarf = open_dwarf
        self._dwarf: Any = None
        self._ranges: list[tuple[int, int, Any]] | None = None
        self._starts: list[int] = []
        self._aranges: Any = None
        self._units: dict[int, _Unit] = {}
        self._abbrev_data = b""
        self._cache: Memo[int, tuple[SourceFrame, ...]] = Memo(_CACHE_LIMIT)

    def frames(self, pc: int) -> tuple[SourceFrame, ...]:
        try:
            return self._cache[pc]
        except KeyError:
            pass
        try:
            found = self._frames(pc)
        except Exception:  # pyelftools raises many kinds of errors on odd DWARF
            found = ()
        return self._cache.put(pc, found)

    def _frames(self, pc: int) -> tuple[SourceFrame, ...]:
        cu = self._cu_for(pc)
        if cu is None:
            return ()
        unit = self._units.get(cu.cu_offset)
        if unit is None:
            unit = self._units[cu.cu_offset] = _Unit(self._dwarf, cu, self._abbrev_data)
        file, line = unit.line_at(pc)
        out: list[SourceFrame] = []
        for die in reversed(self._inline_chain(unit, cu, pc)):  # innermost inlined call first
            out.append(SourceFrame(_name(die), file, line))
            call_file = die.attributes.get("DW_AT_call_file")
            file = unit.file(call_file.value) if call_file is not None else None
            call_line = die.attributes.get("DW_AT_call_line")
            line = call_line.value if call_line is not None else None
        out.append(SourceFrame(None, file, line))
        return tuple(out)

    def _inline_chain(self, unit: _Unit, cu: Any, pc: int) -> list[Any]:
        """The DW_TAG_inlined_subroutine DIEs containing pc, outermost first: found by the walk
        over the unit's bytes, by pyelftools' DIEs where the walk cannot read them."""
        if unit.walk is not None:

            def ranges_of(offset: int) -> list[tuple[int, int]]:
                return _die_ranges(cu.get_DIE_from_refaddr(cu.cu_offset + offset), self._dwarf, cu)

            try:
                scopes = unit.walk.scopes_at(cu.cu_die_offset - cu.cu_offset, pc, ranges_of)
            except CfiDecodeError:
                pass
            else:
                inlined = [s.offset for s in scopes if s.tag == TAG_INLINED_SUBROUTINE]
                return [cu.get_DIE_from_refaddr(cu.cu_offset + offset) for offset in inlined]
        return _dies_inline_chain(cu.get_top_DIE(), pc, self._dwarf, cu)

    def _cu_for(self, pc: int) -> Any:
        if self._ranges is None:
            self._ranges = []
            self._dwarf = self._open_dwarf()
            if self._dwarf is None:
                return None
            abbrev = self._dwarf.debug_abbrev_sec
            self._abbrev_data = _read(abbrev.stream, 0, abbrev.size)
            self._aranges = self._dwarf.get_aranges()
            if self._aranges is None:
                self._index_units()
        if self._aranges is not None:
            # .debug_aranges names the unit without parsing any other: a kernel's 3,000
            # units' top DIEs take minutes in pure Python, one unit's a moment.
            offset = self._aranges.cu_offset_at_addr(pc)
            return None if offset is None else self._dwarf.get_CU_at(offset)
        i = bisect_right(self._starts, pc) - 1
        if i >= 0 and pc < self._ranges[i][1]:
            return self._ranges[i][2]
        return None

    def _index_units(self) -> None:
        """Every unit's address ranges, from its top DIE (DWARF without .debug_aranges)."""
        assert self._ranges is not None
        for cu in self._dwarf.iter_CUs():
            for low, high in _die_ranges(cu.get_top_DIE(), self._dwarf, cu):
                self._ranges.append((low, high, cu))
        self._ranges.sort(key=lambda r: r[0])
        self._starts = [r[0] for r in self._ranges]


def _read(stream: Any, offset: int, size: int) -> bytes:
    stream.seek(offset)
    data: bytes = stream.read(size)
    return data


def _program_code(program: Any) -> bytes:
    """The opcodes of a pyelftools LineProgram, read from its section's stream."""
    start, end = program.program_start_offset, program.program_end_offset
    return _read(program.stream, start, end - start)


def _header(program: Any, cu: Any) -> LineHeader:
    header = program.header
    return LineHeader(
        min_instruction_length=header["minimum_instruction_length"],
        max_ops_per_instruction=header.get("maximum_operations_per_instruction") or 1,
        line_base=header["line_base"],
        line_range=header["line_range"],
        opcode_base=header["opcode_base"],
        standard_opcode_lengths=tuple(header["standard_opcode_lengths"]),
        address_size=cu["address_size"],
    )


def _dies_inline_chain(die: Any, pc: int, dwarf: Any, cu: Any) -> list[Any]:
    """The DW_TAG_inlined_subroutine DIEs containing pc below ``die``, outermost first."""
    chain: list[Any] = []
    for child in die.iter_children():
        tag = child.tag
        if tag not in ("DW_TAG_subprogram", "DW_TAG_inlined_subroutine", "DW_TAG_lexical_block"):
            continue
        if any(low <= pc < high for low, high in _die_ranges(child, dwarf, cu)):
            if tag == "DW_TAG_inlined_subroutine":
                chain.append(child)
            return chain + _dies_inline_chain(child, pc, dwarf, cu)
    return chain


def _die_ranges(die: Any, dwarf: Any, cu: Any) -> list[tuple[int, int]]:
    attrs = die.attributes
    if "DW_AT_low_pc" in attrs and "DW_AT_high_pc" in attrs:
        low = attrs["DW_AT_low_pc"].value
        high = attrs["DW_AT_high_pc"]
        # DWARF 4+: a constant-class high_pc is a length, an address-class one an address.
        end = high.value if high.form == "DW_FORM_addr" else low + high.value
        return [(low, end)]
    if "DW_AT_ranges" not in attrs:
        return []
    base = cu.get_top_DIE().attributes.get("DW_AT_low_pc")
    base_addr = base.value if base is not None else 0
    out = []
    for entry in dwarf.range_lists().get_range_list_at_offset(attrs["DW_AT_ranges"].value, cu=cu):
        if hasattr(entry, "base_address"):
            base_addr = entry.base_address
        elif getattr(entry, "is_absolute", False):
            out.append((entry.begin_offset, entry.end_offset))
        else:
            out.append((base_addr + entry.begin_offset, base_addr + entry.end_offset))
    return out


def _name(die: Any) -> str | None:
    for _ in range(4):  # follow abstract_origin / specification links to the named DIE
        name = die.attributes.get("DW_AT_name")
        if name is not None:
            text: str = name.value.decode("utf-8", "replace")
            return text
        for link in ("DW_AT_abstract_origin", "DW_AT_specification"):
            if link in die.attributes:
                die = die.get_DIE_from_attribute(link)
                break
        else:
            return None
    return None
