"""A kernel's global variables and C types, read from its DWARF (2 to 5), for the expressions of
a kernel description (``guest/describe``).

A type is a ``CType`` value; the types it refers to (a pointer's target, an array's element, a
member's type) are keys of the ``TypeTable`` that made it, read when first asked for: a kernel's
types refer to each other in cycles (a list node's pointer to its own struct). Typedefs and
qualifiers (const, volatile) are stepped through, the typedef's name kept for messages.
A global is found by its plain name (at a unit's top level or in a namespace: Rust's modules)
among the units whose bytes name it (``dwarfunits``); its address is
its ``DW_OP_addr`` location, on its definition (a C ``extern`` declared in a header and defined
in one file has its location on a DIE that points back by ``DW_AT_specification``).

What is not read: bit fields (no offset in bytes: the expressions refuse them), a member whose
offset is a DWARF expression other than DWARF 2's ``DW_OP_plus_uconst``, the dimensions of a
multi-dimensional array past the first, and Rust's enums (``DW_TAG_variant_part``: a Rust
struct's plain fields are read as a C struct's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from qmpprof.elf.dwarfunits import Unit, units_naming

if TYPE_CHECKING:
    from qmpprof.elf.image import ElfImage

_DW_OP_ADDR, _DW_OP_PLUS_UCONST = 0x03, 0x23
_SEARCHED = (".debug_info", ".debug_str", ".debug_abbrev")
_STEPPED = ("DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type", "DW_TAG_restrict_type")
_AGGREGATES = {"DW_TAG_structure_type": "struct", "DW_TAG_union_type": "union",
               "DW_TAG_class_type": "struct"}  # fmt: skip
_SIGNED = (5, 6)  # DW_ATE_signed, DW_ATE_signed_char
_CHARS = (6, 8, 0x10)  # DW_ATE_signed_char, DW_ATE_unsigned_char, DW_ATE_UTF (Rust's char)
_FLOAT = 4  # DW_ATE_float


@dataclass(frozen=True, slots=True)
class Member:
    """A struct's member: its name, byte offset, type (a key); ``bits``: a bit field."""

    name: str
    offset: int
    type: int
    bits: bool = False


@dataclass(frozen=True, slots=True)
class CType:
    """One C type. ``kind``: int, float, pointer, array, struct, union, void or function;
    ``target``: a pointer's or an array's element type (a key; None: void); ``count``: an
    array's elements (None when DWARF gives no bound)."""

    kind: str
    name: str
    size: int
    signed: bool = False
    char: bool = False
    target: int | None = None
    count: int | None = None
    members: tuple[Member, ...] = ()

    def member(self, name: str) -> Member | None:
        return next((m for m in self.members if m.name == name), None)


@dataclass(frozen=True, slots=True)
class Variable:
    """A global variable: its link address and type (a key)."""

    name: str
    addr: int
    type: int


class TypeSource(Protocol):
    """Globals and types by name, types by key: the kernel's DWARF, or a test's table."""

    @property
    def address_size(self) -> int: ...

    def variable(self, name: str) -> Variable | None: ...

    def named(self, name: str) -> int | None:
        """The key of the type C names so (``struct proc``, ``uint``, ``int``), None if none."""
        ...

    def type(self, key: int) -> CType: ...

    def pointer_to(self, key: int | None) -> int:
        """The key of a pointer to the type ``key`` (None: void)."""
        ...


class TypeTable:
    """Types by key: those read from DWARF (keys: DIE offsets in ``.debug_info``) and pointer
    types made for ``&`` and casts (negative keys)."""

    def __init__(self, address_size: int) -> None:
        self.address_size = address_size
        self._types: dict[int, CType] = {}
        self._pointers: dict[int | None, int] = {}

    def put(self, key: int, ctype: CType) -> int:
        self._types[key] = ctype
        return key

    def type(self, key: int) -> CType:
        return self._types[key]

    def known(self, key: int) -> bool:
        return key in self._types

    def pointer_to(self, key: int | None) -> int:
        made = self._pointers.get(key)
        if made is None:
            target = "void" if key is None else self.type(key).name
            made = -1 - len(self._pointers)
            self._types[made] = CType("pointer", f"{target} *", self.address_size, target=key)
            self._pointers[key] = made
        return made


class DwarfTypes(TypeTable):
    """The ``TypeSource`` of an ELF's DWARF."""

    def __init__(self, image: ElfImage) -> None:
        super().__init__(image.arch.address_size)
        self._image = image
        self._dwarf = image.dwarf_info()
        self._variables: dict[str, Variable | None] = {}
        self._named: dict[str, int | None] = {}

    @property
    def has_dwarf(self) -> bool:
        return self._dwarf is not None

    def variable(self, name: str) -> Variable | None:
        if name not in self._variables:
            self._variables[name] = self._find_variable(name)
        return self._variables[name]

    def named(self, name: str) -> int | None:
        if name not in self._named:
            self._named[name] = self._find_type(name)
        return self._named[name]

    def type(self, key: int) -> CType:
        if not self.known(key):
            self.put(key, self._read(self._dwarf.get_DIE_from_refaddr(key)))
        return super().type(key)

    @cached_property
    def _cus(self) -> tuple[list[Any], list[Unit]]:
        """The image's units, as pyelftools reads them and as ``units_naming`` searches them."""
        cus = [] if self._dwarf is None else list(self._dwarf.iter_CUs())
        units = [
            Unit(cu.cu_offset, cu.cu_offset + cu.size, cu["debug_abbrev_offset"],
                 cu.structs.dwarf_format == 64)
            for cu in cus
        ]  # fmt: skip
        return cus, units

    def _units(self, name: str) -> Iterator[Any]:
        """The units that may hold a DIE named ``name`` (a byte search first: see above)."""
        cus, units = self._cus
        info, strings, abbrev = (self._image.section(s) or b"" for s in _SEARCHED)
        naming = units_naming(units, info, strings, abbrev, [name])
        yield from (cu for cu in cus if cu.cu_offset in naming)

    def _find_variable(self, name: str) -> Variable | None:
        for cu in self._units(name):
            for die in _declared(cu.get_top_DIE()):
                if die.tag != "DW_TAG_variable":
                    continue
                named = die
                if "DW_AT_specification" in die.attributes:
                    named = die.get_DIE_from_attribute("DW_AT_specification")
                addr = _address(die)
                if _name(named) == name and addr is not None and "DW_AT_type" in named.attributes:
                    return Variable(name, addr, _ref(named, "DW_AT_type"))
        return None

    def _find_type(self, name: str) -> int | None:
        tag, _, plain = name.partition(" ")
        tags = [t for t, word in _AGGREGATES.items() if word == tag] if plain else []
        tags += ["DW_TAG_enumeration_type"] if tag == "enum" and plain else []
        wanted = tags or ["DW_TAG_typedef", "DW_TAG_base_type"]
        plain = plain or name
        for cu in self._units(plain):
            for die in _declared(cu.get_top_DIE()):
                declared = "DW_AT_declaration" in die.attributes
                if die.tag in wanted and not declared and _name(die) == plain:
                    return int(die.offset)
        return None

    def _read(self, die: Any) -> CType:
        """The CType of ``die``, typedefs and qualifiers stepped through."""
        shown = None
        while die.tag in _STEPPED and "DW_AT_type" in die.attributes:
            shown = shown or _name(die)
            die = die.get_DIE_from_attribute("DW_AT_type")
        if die.tag in _STEPPED:  # a qualifier of nothing: void
            return CType("void", shown or "void", 0)
        found = self._plain(die)
        return found if shown is None else _renamed(found, shown)

    def _plain(self, die: Any) -> CType:
        tag, name = die.tag, _name(die)
        size = die.attributes["DW_AT_byte_size"].value if "DW_AT_byte_size" in die.attributes else 0
        if tag == "DW_TAG_base_type":
            encoding = die.attributes["DW_AT_encoding"].value
            kind = "float" if encoding == _FLOAT else "int"
            return CType(kind, name or "?", size, encoding in _SIGNED, encoding in _CHARS)
        if tag == "DW_TAG_enumeration_type":
            return CType("int", f"enum {name or '?'}", size or 4, signed=True)
        if tag in ("DW_TAG_pointer_type", "DW_TAG_reference_type"):
            target = _ref(die, "DW_AT_type") if "DW_AT_type" in die.attributes else None
            shown = "void" if target is None else self.type(target).name
            return CType("pointer", f"{shown} *", size or self.address_size, target=target)
        if tag == "DW_TAG_array_type":
            element = _ref(die, "DW_AT_type")
            count = _count(die)
            whole = 0 if count is None else count * self.type(element).size
            return CType("array", f"{self.type(element).name}[]", whole, target=element,
                         count=count)  # fmt: skip
        if tag in _AGGREGATES:
            members = tuple(_members(die))
            return CType(_AGGREGATES[tag], f"{_AGGREGATES[tag]} {name or '?'}", size,
                         members=members)  # fmt: skip
        if tag == "DW_TAG_subroutine_type":
            return CType("function", name or "function", 0)
        return CType("void", name or "void", 0)


def _declared(top: Any) -> Iterator[Any]:
    """The DIEs declared at a unit's top level and in its namespaces (C++'s, Rust's modules:
    a Rust global or type is in its crate's namespace), by their plain names."""
    for die in top.iter_children():
        if die.tag == "DW_TAG_namespace":
            yield from _declared(die)
        else:
            yield die


def _renamed(found: CType, name: str) -> CType:
    return CType(found.kind, name, found.size, found.signed, found.char, found.target,
                 found.count, found.members)  # fmt: skip


def _name(die: Any) -> str | None:
    attr = die.attributes.get("DW_AT_name")
    if attr is None:
        return None
    value = attr.value
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _ref(die: Any, attribute: str) -> int:
    return int(die.get_DIE_from_attribute(attribute).offset)


def _address(die: Any) -> int | None:
    """A variable's static address: its location as one ``DW_OP_addr``."""
    attr = die.attributes.get("DW_AT_location")
    if attr is None or not isinstance(attr.value, list | bytes) or not attr.value:
        return None
    expr = bytes(attr.value)
    size = die.cu["address_size"]
    if expr[0] != _DW_OP_ADDR or len(expr) != 1 + size:
        return None
    return int.from_bytes(expr[1:], "little")


def _count(die: Any) -> int | None:
    """The first dimension of an array type."""
    for child in die.iter_children():
        if child.tag != "DW_TAG_subrange_type":
            continue
        if "DW_AT_count" in child.attributes:
            value = child.attributes["DW_AT_count"].value
            return value if isinstance(value, int) else None
        if "DW_AT_upper_bound" in child.attributes:
            value = child.attributes["DW_AT_upper_bound"].value
            return value + 1 if isinstance(value, int) else None
        return None
    return None


def _members(die: Any) -> Iterator[Member]:
    for child in die.iter_children():
        if child.tag != "DW_TAG_member" or "DW_AT_type" not in child.attributes:
            continue
        bits = "DW_AT_bit_size" in child.attributes
        offset = _offset(child.attributes.get("DW_AT_data_member_location"))
        name = _name(child)
        if name is not None and (offset is not None or bits):
            yield Member(name, offset or 0, _ref(child, "DW_AT_type"), bits)


def _offset(attr: Any) -> int | None:
    """A member's byte offset: a constant, or DWARF 2's ``DW_OP_plus_uconst N``; an absent one
    is 0 (a union's members)."""
    if attr is None:
        return 0
    if isinstance(attr.value, int):
        return int(attr.value)
    expr = bytes(attr.value)
    if not expr or expr[0] != _DW_OP_PLUS_UCONST:
        return None
    value = shift = 0
    for byte in expr[1:]:
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value
    return None
