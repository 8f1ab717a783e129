"""A unit's DIE tree (.debug_info, DWARF 2 to 5) walked over its bytes to the scopes around a pc.

--lines needs, of a unit's thousands of DIEs, only the functions, inlined calls and lexical
blocks that contain one pc. pyelftools builds an object per DIE with every attribute decoded,
~50 µs each, and a kernel unit's top level alone holds thousands (types, declarations). Here
attributes are skipped by their form's size; only a DIE's tag, its children flag, its sibling
link and its address range are read, and a subtree is stepped over by its sibling link.

A range in any other form (DW_AT_ranges, an address in .debug_addr) is the caller's to read.
Bytes the walk does not know (a vendor's form, a truncated unit) raise CfiDecodeError, for the
caller to fall back on a reader that knows more. A skeleton unit (split DWARF) has no children
here: its DIEs are in a .dwo file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qmpprof.dwarf.encoding import CfiDecodeError, Reader

TAG_INLINED_SUBROUTINE, TAG_LEXICAL_BLOCK, TAG_SUBPROGRAM = 0x1D, 0x0B, 0x2E
SCOPES = frozenset((TAG_INLINED_SUBROUTINE, TAG_LEXICAL_BLOCK, TAG_SUBPROGRAM))
_AT_SIBLING, _AT_LOW_PC, _AT_HIGH_PC, _AT_RANGES = 0x01, 0x11, 0x12, 0x55
_FORM_ADDR, _FORM_INDIRECT, _FORM_IMPLICIT_CONST = 0x01, 0x16, 0x21
_FORM_REF_ADDR = 0x10
_UNIT_REFS = frozenset((0x11, 0x12, 0x13, 0x14, 0x15))  # ref1, ref2, ref4, ref8, ref_udata
_LENGTH_PREFIXED = {0x03: 2, 0x04: 4, 0x09: 0, 0x0A: 1, 0x18: 0}  # blocks, exprloc; 0 = ULEB128
_CONSTANTS = {0x05: 2, 0x06: 4, 0x07: 8, 0x0B: 1, 0x0F: 0}  # data2/4/8, data1, udata
_FIXED = {0x0C: 1, 0x11: 1, 0x12: 2, 0x13: 4, 0x14: 8, 0x1C: 4, 0x1E: 16, 0x20: 8, 0x24: 8}
_FIXED |= {0x25: 1, 0x26: 2, 0x27: 3, 0x28: 4, 0x29: 1, 0x2A: 2, 0x2B: 3, 0x2C: 4}
_FIXED |= {0x19: 0, 0x21: 0}  # flag_present, implicit_const: no bytes in the DIE
_ULEB = frozenset((0x0D, 0x0F, 0x15, 0x1A, 0x1B, 0x22, 0x23, 0x1F01, 0x1F02))  # sdata read alike
_OFFSETS = frozenset((0x0E, 0x17, 0x1D, 0x1F, 0x1F20, 0x1F21))  # strp, sec_offset, line_strp…

_WANTED = frozenset((_AT_SIBLING, _AT_LOW_PC, _AT_HIGH_PC, _AT_RANGES))

Spec = tuple[int, int, int]  # (attribute, form, size in bytes or -1 when it varies)


@dataclass(frozen=True, slots=True)
class UnitShape:
    """What a unit's header says about how its DIEs are encoded."""

    version: int
    offset_size: int  # 4 in 32-bit DWARF, 8 in 64-bit
    address_size: int

    def size_of(self, form: int) -> int:
        """The bytes a value of ``form`` takes in a DIE; -1 when the value itself says."""
        if form in _FIXED:
            return _FIXED[form]
        if _CONSTANTS.get(form):  # udata (0) varies
            return _CONSTANTS[form]
        if form == _FORM_ADDR or (form == _FORM_REF_ADDR and self.version == 2):
            return self.address_size
        if form in _OFFSETS or form == _FORM_REF_ADDR:
            return self.offset_size
        return -1


@dataclass(frozen=True, slots=True)
class Abbrev:
    """One abbreviation: a DIE's tag, whether children follow it, its attributes' forms."""

    tag: int
    has_children: bool
    specs: tuple[Spec, ...]
    skip: int | None  # the size of its attributes when all are fixed and none is read


def abbrevs_at(data: bytes, offset: int, shape: UnitShape) -> dict[int, Abbrev]:
    """The abbreviation table starting at ``offset`` of .debug_abbrev."""
    r = Reader(data, offset)
    table: dict[int, Abbrev] = {}
    while code := r.uleb():
        tag, has_children = r.uleb(), r.u8() != 0
        specs: list[Spec] = []
        while True:
            attribute, form = r.uleb(), r.uleb()
            if attribute == 0 and form == 0:
                break
            if form == _FORM_IMPLICIT_CONST:
                r.sleb()  # its value sits here, not in the DIE: --lines reads none of them
            specs.append((attribute, form, shape.size_of(form)))
        plain = all(size >= 0 and attribute not in _WANTED for attribute, _, size in specs)
        skip = sum(size for _, _, size in specs) if plain else None
        table[code] = Abbrev(tag, has_children, tuple(specs), skip)
    return table


@dataclass(frozen=True, slots=True)
class Die:
    """One DIE as the walk reads it; ``end`` is where its next sibling starts, None when only
    walking its children would tell (no DW_AT_sibling)."""

    offset: int  # in the unit's bytes
    tag: int
    first_child: int | None
    end: int | None
    span: tuple[int, int] | None  # [low, high) from DW_AT_low_pc/high_pc given as address+size
    other_ranges: bool  # no span but DW_AT_ranges, or low/high in forms read elsewhere


class UnitWalk:
    """A unit's bytes (from its first byte), its abbreviations and its header's shape."""

    def __init__(self, data: bytes, abbrevs: dict[int, Abbrev], shape: UnitShape) -> None:
        self.data, self.abbrevs, self.shape = data, abbrevs, shape
        self._levels: dict[int, list[Die]] = {}  # first child's offset -> the scopes there
        self._ranges: dict[int, list[tuple[int, int]]] = {}  # ranges_of's answers by offset

    def scopes_at(
        self, top: int, pc: int, ranges_of: Callable[[int], list[tuple[int, int]]]
    ) -> list[Die]:
        """The scopes containing ``pc`` below the DIE at ``top``, outermost first: at each level
        the first function, inlined call or lexical block that has it. ``ranges_of(offset)``
        gives the ranges of a scope whose range is not a plain address and size."""
        chain: list[Die] = []
        level = self.die(top).first_child
        while level is not None:
            for die in self._scopes(level):
                if die.span is not None:
                    spans = [die.span]
                elif die.other_ranges:
                    if die.offset not in self._ranges:
                        self._ranges[die.offset] = ranges_of(die.offset)
                    spans = self._ranges[die.offset]
                else:  # a declaration or an abstract instance: no code of its own
                    continue
                if any(low <= pc < high for low, high in spans):
                    chain.append(die)
                    level = die.first_child
                    break
            else:
                break
        return chain

    def _scopes(self, first: int) -> list[Die]:
        """The scopes among the children starting at ``first``, read once per unit."""
        found = self._levels.get(first)
        if found is None:
            found = []
            offset = first
            while (die := self.die(offset)).tag != 0:
                if die.tag in SCOPES:
                    found.append(die)
                offset = die.end if die.end is not None else self._skip_children(die.first_child)
            self._levels[first] = found  # only once whole: a DIE that cannot be read raises again
        return found

    def die(self, offset: int) -> Die:
        """The DIE at ``offset``; CfiDecodeError when its bytes cannot be read."""
        data = self.data
        r = Reader(data, offset, address_size=self.shape.address_size)
        code = r.uleb()
        if code == 0:
            return Die(offset, 0, None, r.pos, None, False)
        abbrev = self.abbrevs.get(code)
        if abbrev is None:
            raise CfiDecodeError(f"no abbreviation {code} for the DIE at {offset:#x}")
        sibling = low = high = None
        address_high = has_low = has_high = has_ranges = False
        if abbrev.skip is not None:  # most DIEs: nothing to read, a fixed size to step over
            r.pos += abbrev.skip
        else:
            for attribute, form, size in abbrev.specs:
                if size < 0:
                    value = self._value(r, form)
                elif attribute in _WANTED:
                    value = int.from_bytes(r.block(size), "little")
                else:
                    r.pos += size
                    continue
                if attribute == _AT_SIBLING and form in _UNIT_REFS:
                    sibling = value
                elif attribute == _AT_LOW_PC:
                    has_low, low = True, value if form == _FORM_ADDR else None
                elif attribute == _AT_HIGH_PC:
                    has_high, address_high = True, form == _FORM_ADDR
                    high = value if address_high or form in _CONSTANTS else None
                elif attribute == _AT_RANGES:
                    has_ranges = True
        if r.pos > len(data):
            raise CfiDecodeError(f"the DIE at {offset:#x} runs past its unit")
        span = None
        if low is not None and high is not None:
            span = (low, high if address_high else low + high)
        other = span is None and (has_ranges or (has_low and has_high))
        if not abbrev.has_children:
            return Die(offset, abbrev.tag, None, r.pos, span, other)
        if sibling is not None and sibling <= offset:  # a link backwards would walk forever
            sibling = None
        return Die(offset, abbrev.tag, r.pos, sibling, span, other)

    def _skip_children(self, offset: int | None) -> int:
        """Where the list of children starting at ``offset`` ends (after its null entry)."""
        assert offset is not None  # a DIE with no sibling link is one with children
        while True:
            die = self.die(offset)
            if die.end is None:
                offset = self._skip_children(die.first_child)
            elif die.tag == 0:
                return die.end
            else:
                offset = die.end

    def _value(self, r: Reader, form: int) -> int:
        """The value of a form of varying size as a number (0 for strings and blocks), the
        reader past it."""
        if form in _ULEB:
            value = r.uleb()
        elif form in _LENGTH_PREFIXED:
            size = _LENGTH_PREFIXED[form]
            length = int.from_bytes(r.block(size), "little") if size else r.uleb()
            r.pos += length  # after the length is read: ``r.pos +=`` would take pos before it
            value = 0
        elif form == 0x08:  # string: inline, NUL-terminated
            r.cstring()
            value = 0
        elif form == _FORM_INDIRECT:
            form = r.uleb()
            size = self.shape.size_of(form)
            value = int.from_bytes(r.block(size), "little") if size >= 0 else self._value(r, form)
        else:
            raise CfiDecodeError(f"unknown DWARF form {form:#x}")
        return value
