"""units_naming over hand-built .debug_info, .debug_str and .debug_abbrev bytes."""

from __future__ import annotations

from qmpprof.elf.dwarfunits import Unit, units_naming

# .debug_str: "epc" at 0 (its tail "pc" at 1, as a linker merging tails leaves it), "sp" at 4.
STRINGS = b"epc\0sp\0"


def abbrev_table(*decls: tuple[int, list[tuple[int, int]]]) -> bytes:
    """One table: each (tag, [(attribute, form)]) numbered from 1, no children."""
    out = b""
    for code, (tag, specs) in enumerate(decls, 1):
        out += bytes((code, tag, 0))
        for attr, form in specs:
            out += bytes((attr, form))
        out += b"\0\0"  # the declaration's end
    return out + b"\0"  # the table's end


UNIT_NAME_LINE_STRP = (0x11, [(0x03, 0x1F)])  # DW_TAG_compile_unit, DW_AT_name line_strp
MEMBER = (0x0D, [(0x03, 0x08), (0x03, 0x0E), (0x49, 0x13)])  # name string/strp, type ref4
PLAIN = abbrev_table(UNIT_NAME_LINE_STRP, MEMBER)
NAME_STRX = abbrev_table((0x0D, [(0x03, 0x1A)]))  # DW_FORM_strx: an index, not searchable
TYPE_REF_ADDR = abbrev_table((0x0D, [(0x03, 0x08), (0x49, 0x10)]))  # DW_FORM_ref_addr
ABBREV = PLAIN + NAME_STRX + TYPE_REF_ADDR
AT_PLAIN, AT_STRX, AT_REF_ADDR = 0, len(PLAIN), len(PLAIN) + len(NAME_STRX)


def units_of(*contents: bytes, abbrevs: tuple[int, ...] | None = None) -> tuple[list[Unit], bytes]:
    """Units holding ``contents`` back to back (each unit's bytes stand for its DIEs)."""
    units, at = [], 0
    for i, content in enumerate(contents):
        abbrev = AT_PLAIN if abbrevs is None else abbrevs[i]
        units.append(Unit(at, at + len(content), abbrev))
        at += len(content)
    return units, b"".join(contents)


def strp(offset: int) -> bytes:
    return offset.to_bytes(4, "little")


def test_a_name_inline_or_at_its_string_offset_keeps_its_unit() -> None:
    units, info = units_of(b"\x01pc\0\x01", b"\x01" + strp(1), b"\x02" + strp(0) + b"pcx\0")
    # The third names "epc" (offset 0) and "pcx": neither is "pc".
    assert units_naming(units, info, STRINGS, ABBREV, ["pc"]) == {0, 5}


def test_a_unit_is_kept_only_when_it_names_every_one() -> None:
    units, info = units_of(b"pc\0" + strp(4), b"pc\0x", strp(4) + b"\0")
    assert units_naming(units, info, STRINGS, ABBREV, ["pc", "sp"]) == {0}


def test_a_name_across_two_units_is_no_units_name() -> None:
    units, info = units_of(b"\x01p", b"c\0\x01")
    assert units_naming(units, info, STRINGS, ABBREV, ["pc"]) == set()


def test_units_the_search_cannot_see_through_are_kept() -> None:
    units, info = units_of(b"x", b"x", b"x", abbrevs=(AT_PLAIN, AT_STRX, AT_REF_ADDR))
    sixty_four = Unit(3, 3, AT_PLAIN, dwarf64=True)
    found = units_naming([*units, sixty_four], info, STRINGS, ABBREV, ["pc"])
    assert found == {1, 2, 3}


def test_a_truncated_abbreviation_table_keeps_its_unit() -> None:
    units, info = units_of(b"x")
    assert units_naming(units, info, STRINGS, PLAIN[:5], ["pc"]) == {0}


def test_an_implicit_const_value_is_skipped_not_read_as_an_attribute() -> None:
    # DW_AT_decl_line (0x3b) by DW_FORM_implicit_const (0x21), its value the sleb 0x49: read as
    # an attribute, 0x49 0x03 would be a DW_AT_type by DW_FORM_block2, not searchable.
    table = bytes((1, 0x0D, 0, 0x3B, 0x21, 0x49, 0x03, 0x08, 0, 0, 0))
    units, info = units_of(b"x")
    assert units_naming(units, info, STRINGS, table, ["pc"]) == set()
