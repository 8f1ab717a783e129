"""The walk over a unit's DIEs, on units built by hand from DWARF 5 sections 7.5.1 to 7.5.6."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from qmpprof.dwarf.dies import UnitShape, UnitWalk, abbrevs_at
from qmpprof.dwarf.encoding import CfiDecodeError

COMPILE_UNIT, SUBPROGRAM, INLINED, LEXICAL_BLOCK, VARIABLE = 0x11, 0x2E, 0x1D, 0x0B, 0x34
SIBLING, LOW_PC, HIGH_PC, RANGES, DECL_LINE = 0x01, 0x11, 0x12, 0x55, 0x3B
ADDR, DATA4, REF4, ADDRX, IMPLICIT_CONST, INDIRECT = 0x01, 0x06, 0x13, 0x1B, 0x21, 0x16
V5 = UnitShape(version=5, offset_size=4, address_size=8)


def uleb(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def sleb(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        done = value == (-1 if byte & 0x40 else 0)
        out.append(byte | (0 if done else 0x80))
        if done:
            return bytes(out)


@dataclass
class Unit:
    """A unit's abbreviations and DIEs, written one at a time; offsets count from the unit's
    first byte, after a header of ``header`` bytes (12 in 32-bit DWARF 5)."""

    shape: UnitShape = V5
    header: int = 12
    abbrev: bytearray = field(default_factory=bytearray)
    info: bytearray = field(default_factory=bytearray)
    codes: int = 0

    def kind(self, tag: int, children: bool, *specs: tuple[int, int], const: int = 7) -> int:
        """A new abbreviation (``const``: the value of its DW_FORM_implicit_const ones)."""
        self.codes += 1
        self.abbrev += uleb(self.codes) + uleb(tag) + bytes([children])
        for attribute, form in specs:
            self.abbrev += uleb(attribute) + uleb(form)
            if form == IMPLICIT_CONST:
                self.abbrev += sleb(const)
        self.abbrev += b"\0\0"
        return self.codes

    def die(self, code: int, *values: bytes) -> int:
        """Appends a DIE; returns its offset."""
        offset = self.here()
        self.info += uleb(code) + b"".join(values)
        return offset

    def end(self) -> None:
        """The null entry closing a list of children."""
        self.info += b"\0"

    def here(self) -> int:
        return self.header + len(self.info)

    def walk(self) -> UnitWalk:
        abbrevs = abbrevs_at(bytes(self.abbrev + b"\0"), 0, self.shape)
        return UnitWalk(bytes(self.header) + bytes(self.info), abbrevs, self.shape)


def addr(value: int) -> bytes:
    return value.to_bytes(8, "little")


def u32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def no_ranges(offset: int) -> list[tuple[int, int]]:
    raise AssertionError(f"the DIE at {offset:#x} has a plain range")


def offsets(
    walk: UnitWalk, pc: int, ranges_of: Callable[[int], list[tuple[int, int]]] = no_ranges
) -> list[int]:
    return [die.offset for die in walk.scopes_at(12, pc, ranges_of)]


# Every form of DWARF 5 (7.5.6) and the GNU ones gcc writes, with a value of it as it stands in
# a 32-bit DWARF 5 unit with 8-byte addresses.
FORMS = {
    0x01: addr(0x1234),  # addr
    0x03: b"\x02\x00ab",  # block2
    0x04: b"\x01\x00\x00\x00z",  # block4
    0x05: b"\x01\x02",  # data2
    0x06: u32(5),  # data4
    0x07: addr(5),  # data8
    0x08: b"name\0",  # string
    0x09: uleb(130) + bytes(130),  # block: a two-byte length
    0x0A: b"\x03abc",  # block1
    0x0B: b"\x09",  # data1
    0x0C: b"\x01",  # flag
    0x0D: b"\xff\x7f",  # sdata
    0x0E: u32(0x40),  # strp
    0x0F: b"\x80\x01",  # udata
    0x10: u32(0x99),  # ref_addr: offset-sized since DWARF 3
    0x11: b"\x10",  # ref1
    0x12: b"\x10\x00",  # ref2
    0x13: u32(0x10),  # ref4
    0x14: addr(0x10),  # ref8
    0x15: b"\x90\x01",  # ref_udata
    0x16: uleb(0x08) + b"via indirect\0",  # indirect, to a string
    0x17: u32(0x20),  # sec_offset
    0x18: b"\x02\x91\x00",  # exprloc
    0x19: b"",  # flag_present
    0x1A: b"\x81\x01",  # strx
    0x1B: b"\x82\x01",  # addrx
    0x1C: u32(1),  # ref_sup4
    0x1D: u32(1),  # strp_sup
    0x1E: bytes(range(16)),  # data16
    0x1F: u32(0x30),  # line_strp
    0x20: addr(0xABCDEF),  # ref_sig8
    0x21: b"",  # implicit_const: its value is in the abbreviation
    0x22: b"\x83\x01",  # loclistx
    0x23: b"\x84\x01",  # rnglistx
    0x24: addr(2),  # ref_sup8
    0x25: b"\x01",  # strx1
    0x26: b"\x01\x02",  # strx2
    0x27: b"\x01\x02\x03",  # strx3
    0x28: u32(4),  # strx4
    0x29: b"\x01",  # addrx1
    0x2A: b"\x01\x02",  # addrx2
    0x2B: b"\x01\x02\x03",  # addrx3
    0x2C: u32(4),  # addrx4
    0x1F01: b"\x85\x01",  # GNU_addr_index
    0x1F02: b"\x86\x01",  # GNU_str_index
    0x1F20: u32(8),  # GNU_ref_alt
    0x1F21: u32(8),  # GNU_strp_alt
}


@pytest.mark.parametrize("form", FORMS, ids=[f"{form:#x}" for form in FORMS])
def test_every_form_is_stepped_over_by_its_size(form: int) -> None:
    unit = Unit()
    top = unit.kind(COMPILE_UNIT, True)
    # A DIE reading none of its attributes (stepped over whole when its forms are fixed), then
    # one reading its range after the form (read attribute by attribute).
    plain = unit.kind(VARIABLE, False, (DECL_LINE, form))
    function = unit.kind(SUBPROGRAM, False, (DECL_LINE, form), (LOW_PC, ADDR), (HIGH_PC, DATA4))
    unit.die(top)
    unit.die(plain, FORMS[form])
    first = unit.die(function, FORMS[form], addr(0x1000), u32(0x10))
    second = unit.die(function, FORMS[form], addr(0x1010), u32(0x10))
    unit.end()
    walk = unit.walk()
    assert offsets(walk, 0x1000) == [first]
    assert offsets(walk, 0x101F) == [second]
    assert offsets(walk, 0x1020) == []


@pytest.mark.parametrize(
    ("shape", "sizes"),
    [
        (UnitShape(2, 4, 4), {0x10: 4, 0x01: 4, 0x0E: 4}),  # DWARF 2: ref_addr is address-sized
        (UnitShape(2, 4, 8), {0x10: 8, 0x01: 8, 0x17: 4}),
        (UnitShape(3, 4, 8), {0x10: 4, 0x01: 8}),
        (UnitShape(5, 8, 8), {0x10: 8, 0x0E: 8, 0x17: 8, 0x1F: 8, 0x1D: 8, 0x1F21: 8, 0x13: 4}),
        (UnitShape(4, 8, 4), {0x10: 8, 0x01: 4, 0x1F20: 8}),
    ],
    ids=["v2-addr4", "v2-addr8", "v3", "v5-dwarf64", "v4-dwarf64-addr4"],
)
def test_offsets_and_addresses_take_the_sizes_the_header_gives(
    shape: UnitShape, sizes: dict[int, int]
) -> None:
    assert {form: shape.size_of(form) for form in sizes} == sizes
    assert shape.size_of(0x0F) == shape.size_of(0x08) == -1  # udata and strings: read to know


def nested() -> tuple[Unit, dict[str, int]]:
    """f [0x1000, 0x1100) holding a lexical block and in it two inlined calls, the second
    holding a third; g [0x1100, 0x1200) after f's children, which carry no sibling links."""
    unit = Unit()
    top = unit.kind(COMPILE_UNIT, True)
    scope = {
        tag: unit.kind(tag, True, (LOW_PC, ADDR), (HIGH_PC, DATA4))
        for tag in (SUBPROGRAM, LEXICAL_BLOCK, INLINED)
    }
    leaf = unit.kind(INLINED, False, (LOW_PC, ADDR), (HIGH_PC, ADDR))  # an address as its end
    variable = unit.kind(VARIABLE, False, (DECL_LINE, DATA4))
    at = {}
    unit.die(top)
    at["f"] = unit.die(scope[SUBPROGRAM], addr(0x1000), u32(0x100))
    unit.die(variable, u32(3))
    at["block"] = unit.die(scope[LEXICAL_BLOCK], addr(0x1040), u32(0x40))
    at["first"] = unit.die(leaf, addr(0x1040), addr(0x1050))
    at["second"] = unit.die(scope[INLINED], addr(0x1050), u32(0x20))
    at["third"] = unit.die(leaf, addr(0x1060), addr(0x1070))
    for _ in range(3):  # the second call's children end, the block's, f's
        unit.end()
    at["g"] = unit.die(scope[SUBPROGRAM], addr(0x1100), u32(0x100))
    unit.die(variable, u32(4))
    unit.end()  # g's children
    unit.end()  # the unit's
    return unit, at


def test_scopes_nest_outermost_first_through_dies_without_sibling_links() -> None:
    unit, at = nested()
    walk = unit.walk()
    assert offsets(walk, 0x1000) == [at["f"]]
    assert offsets(walk, 0x1045) == [at["f"], at["block"], at["first"]]
    assert offsets(walk, 0x1065) == [at["f"], at["block"], at["second"], at["third"]]
    assert offsets(walk, 0x1050) == [at["f"], at["block"], at["second"]]  # third starts later
    assert offsets(walk, 0x10FF) == [at["f"]]
    assert offsets(walk, 0x1100) == [at["g"]]
    assert offsets(walk, 0x1200) == []


def test_a_sibling_link_steps_over_the_children_unread() -> None:
    unit = Unit()
    top = unit.kind(COMPILE_UNIT, True)
    linked = unit.kind(SUBPROGRAM, True, (SIBLING, REF4), (LOW_PC, ADDR), (HIGH_PC, DATA4))
    unit.die(top)
    f = unit.here()
    skipped = f + 1 + 4 + 8 + 4
    g = skipped + 3
    unit.die(linked, u32(g), addr(0x1000), u32(0x10))
    unit.info += b"\x7f\x7f\0"  # children no abbreviation describes: read, they would raise
    assert unit.here() == g
    unit.die(linked, u32(g + 18), addr(0x2000), u32(0x10))  # past its children's end
    unit.end()
    unit.end()
    walk = unit.walk()
    assert offsets(walk, 0x2008) == [g]
    with pytest.raises(CfiDecodeError):
        offsets(walk, 0x1008)  # in f: its children are read, and cannot be


def test_a_sibling_link_backwards_is_not_followed() -> None:
    unit = Unit()
    top = unit.kind(COMPILE_UNIT, True)
    linked = unit.kind(SUBPROGRAM, True, (SIBLING, REF4), (LOW_PC, ADDR), (HIGH_PC, DATA4))
    unit.die(top)
    f = unit.die(linked, u32(0), addr(0x1000), u32(0x10))  # back to the header: ignored
    unit.end()
    g = unit.die(linked, u32(0), addr(0x2000), u32(0x10))
    unit.end()
    unit.end()
    assert offsets(unit.walk(), 0x1000) == [f]
    assert offsets(unit.walk(), 0x2000) == [g]


def test_ranges_in_other_forms_are_asked_for_once_each() -> None:
    unit = Unit()
    top = unit.kind(COMPILE_UNIT, True)
    listed = unit.kind(SUBPROGRAM, True, (RANGES, 0x17))  # DW_AT_ranges, sec_offset
    indexed = unit.kind(INLINED, False, (LOW_PC, ADDRX), (HIGH_PC, DATA4))  # in .debug_addr
    declared = unit.kind(SUBPROGRAM, False, (DECL_LINE, DATA4))  # no code: never asked
    unit.die(top)
    unit.die(declared, u32(1))
    f = unit.die(listed, u32(0x40))
    call = unit.die(indexed, b"\x03", u32(0x10))
    unit.end()
    unit.end()
    asked: list[int] = []
    spans = {f: [(0x3000, 0x3010), (0x1000, 0x1100)], call: [(0x1080, 0x1090)]}

    def ranges_of(offset: int) -> list[tuple[int, int]]:
        asked.append(offset)
        return spans[offset]

    walk = unit.walk()
    assert offsets(walk, 0x1085, ranges_of) == [f, call]
    assert offsets(walk, 0x3000, ranges_of) == [f]
    assert offsets(walk, 0x1000, ranges_of) == [f]
    assert offsets(walk, 0x2000, ranges_of) == []
    assert asked == [f, call]


def test_implicit_constants_stand_in_the_abbreviation() -> None:
    unit = Unit()
    top = unit.kind(COMPILE_UNIT, True)
    # A multi-byte signed constant in the table: misread, the attributes after it shift.
    function = unit.kind(
        SUBPROGRAM, False, (DECL_LINE, IMPLICIT_CONST), (LOW_PC, ADDR), (HIGH_PC, DATA4), const=-300
    )
    plain = unit.kind(VARIABLE, False, (DECL_LINE, IMPLICIT_CONST), const=1 << 40)
    unit.die(top)
    unit.die(plain)
    f = unit.die(function, addr(0x1000), u32(8))
    unit.end()
    assert offsets(unit.walk(), 0x1007) == [f]


def test_an_indirect_range_is_left_to_the_caller() -> None:
    unit = Unit()
    top = unit.kind(COMPILE_UNIT, True)
    function = unit.kind(SUBPROGRAM, False, (LOW_PC, INDIRECT), (HIGH_PC, INDIRECT))
    unit.die(top)
    f = unit.die(function, uleb(ADDR) + addr(0x1000), uleb(DATA4) + u32(8))
    unit.end()
    assert offsets(unit.walk(), 0x1000, lambda offset: [(0x1000, 0x1008)]) == [f]


@pytest.mark.parametrize(
    "damage",
    ["unknown form", "unknown abbreviation", "truncated", "address size"],
)
def test_bytes_it_cannot_read_raise_every_time(damage: str) -> None:
    unit = Unit(shape=UnitShape(5, 4, 2) if damage == "address size" else V5)
    top = unit.kind(COMPILE_UNIT, True)
    form = 0x2001 if damage == "unknown form" else DATA4  # DW_FORM_LLVM_addrx_offset
    function = unit.kind(SUBPROGRAM, False, (DECL_LINE, form), (LOW_PC, ADDR), (HIGH_PC, DATA4))
    unit.die(top)
    unit.die(function, u32(1), addr(0x1000), u32(8))
    if damage == "unknown abbreviation":
        unit.info += b"\x55"
    unit.end()
    if damage == "truncated":
        del unit.info[-6:]
    walk = unit.walk()
    for _ in range(2):  # nothing half-read is kept: the second look fails alike
        with pytest.raises(CfiDecodeError):
            offsets(walk, 0x2000)


def test_a_truncated_abbreviation_table_raises() -> None:
    with pytest.raises(CfiDecodeError):
        abbrevs_at(uleb(1) + uleb(SUBPROGRAM) + b"\x01" + uleb(LOW_PC), 0, V5)
