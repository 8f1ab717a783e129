"""Which DWARF units of an image may hold DIEs named so: a byte search, before any DIE is parsed.

Parsing every DIE of a large kernel (a Linux vmlinux: 2,000+ units, 190 MB of ``.debug_info``)
takes pyelftools minutes; a search for a few names takes a second. A DIE's name is either in the
unit's own bytes (``DW_FORM_string``: the name and its NUL) or a 4-byte offset into
``.debug_str`` (``DW_FORM_strp``, 32-bit DWARF) at which the name and its NUL stand (maybe the
tail of a longer string: the linker merges tails). So a unit whose bytes hold neither form of a
name has no DIE of that name. A unit the search cannot see through is always kept: 64-bit
DWARF, names in any other form (``strx``, a supplementary file's), types referred to outside
the unit (``ref_addr``, ``ref_sig8``: a DIE's type and its members could lie in another unit).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qmpprof.dwarf.encoding import CfiDecodeError, Reader

_DW_AT_NAME, _DW_AT_TYPE = 0x03, 0x49
_DW_FORM_STRING, _DW_FORM_STRP, _DW_FORM_IMPLICIT_CONST = 0x08, 0x0E, 0x21
_LOCAL_REFS = frozenset((0x11, 0x12, 0x13, 0x14, 0x15))  # ref1, ref2, ref4, ref8, ref_udata
# The unit's own DIE: its name (DW_FORM_line_strp in DWARF 5) is a file's, never searched.
_UNIT_TAGS = frozenset((0x11, 0x3C, 0x41, 0x4A))


@dataclass(frozen=True, slots=True)
class Unit:
    """A unit's byte range in ``.debug_info``, its abbreviation table's offset, whether it is
    64-bit DWARF."""

    start: int
    end: int
    abbrev_offset: int
    dwarf64: bool = False


def units_naming(
    units: Sequence[Unit], info: bytes, strings: bytes, abbrev: bytes, names: Iterable[str]
) -> set[int]:
    """The start offsets of the ``units`` that may hold a DIE named each of ``names`` (and those
    the search cannot see through: see above). ``info``, ``strings``, ``abbrev``: the
    image's ``.debug_info``, ``.debug_str``, ``.debug_abbrev``."""
    plain = {off: _searchable(abbrev, off) for off in {u.abbrev_offset for u in units}}
    opaque = {u.start for u in units if u.dwarf64 or not plain[u.abbrev_offset]}
    kept = [u for u in units if u.start not in opaque]
    patterns = [_patterns(name.encode(), strings) for name in names]
    # The rarest name first: later names are looked for only in the units left.
    for wanted in sorted(patterns, key=len):
        kept = [u for u in kept if any(_holds(info, u, pattern) for pattern in wanted)]
    return opaque | {u.start for u in kept}


def _patterns(name: bytes, strings: bytes) -> list[bytes]:
    """The bytes a DIE named ``name`` leaves in its unit: inline, or one of its string offsets."""
    text = name + b"\0"
    found = [text]
    at = strings.find(text)
    while at >= 0:
        found.append(at.to_bytes(4, "little"))
        at = strings.find(text, at + 1)
    return found


def _holds(info: bytes, unit: Unit, pattern: bytes) -> bool:
    return info.find(pattern, unit.start, unit.end) >= 0


def _searchable(abbrev: bytes, offset: int) -> bool:
    """Whether the abbreviation table at ``offset`` names DIEs only by DW_FORM_string or
    DW_FORM_strp and refers to types only inside the unit (a truncated one: not known, no)."""
    try:
        return _plain_forms(Reader(abbrev, offset))
    except CfiDecodeError:
        return False


def _plain_forms(r: Reader) -> bool:
    while True:
        code = r.uleb()
        if code == 0:
            return True
        tag = r.uleb()
        r.u8()  # DW_CHILDREN_yes / no
        while True:
            attr, form = r.uleb(), r.uleb()
            if attr == 0 and form == 0:
                break
            if form == _DW_FORM_IMPLICIT_CONST:
                r.uleb()  # its value (signed: the same bytes to skip)
            if attr == _DW_AT_NAME and tag not in _UNIT_TAGS:
                if form not in (_DW_FORM_STRING, _DW_FORM_STRP):
                    return False
            elif attr == _DW_AT_TYPE and form not in _LOCAL_REFS:
                return False
