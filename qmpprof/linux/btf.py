"""BTF, the compact type information a Linux kernel carries in its ``.BTF`` section: structs,
their members' offsets and types, array lengths, type sizes, and per-CPU variables' offsets.

qmpprof reads guest kernel structures (the current task, its mm, the module list) at offsets
that differ between builds; BTF gives them for the very kernel that runs, with no table of
versions. The section is a header (magic 0xEB9F), a type section of variable-length records
(ids from 1, 0 being void) and a string section (``include/uapi/linux/btf.h``). Loading walks the
type records once to find where each starts and its kind (0.15 s for a distribution vmlinux's
110 000 types: ``index`` hands that over, for a cache to give back to the next load); names are
indexed and members decoded only when first asked for.
"""

from __future__ import annotations

import enum
import re
import struct
from array import array
from dataclasses import dataclass, field
from functools import cached_property

from qmpprof.elf.image import ElfImage
from qmpprof.memo import Memo

MAGIC = 0xEB9F
_HEADER = struct.Struct("<HBBIIIII")  # magic, version, flags, hdr_len, type/str off and len
_TYPE = struct.Struct("<III")  # name_off, info, size or type
_U32 = struct.Struct("<I")
_ARRAY = struct.Struct("<III")  # element type, index type, nelems
_MEMBER = struct.Struct("<III")  # name_off, type, offset
_SECINFO = struct.Struct("<III")  # type, offset, size
_ENUM, _ENUM_SIGNED, _ENUM64 = struct.Struct("<II"), struct.Struct("<Ii"), struct.Struct("<III")
_MAX_NESTING = 64  # anonymous members within members, arrays of arrays: deeper is a cycle


class BtfError(ValueError):
    """A ``.BTF`` section that cannot be read: malformed from the start, or damage met when a
    type is first read (a record past the section, an unknown kind, a type that contains
    itself)."""


class Kind(enum.IntEnum):
    VOID = 0
    INT = 1
    PTR = 2
    ARRAY = 3
    STRUCT = 4
    UNION = 5
    ENUM = 6
    FWD = 7
    TYPEDEF = 8
    VOLATILE = 9
    CONST = 10
    RESTRICT = 11
    FUNC = 12
    FUNC_PROTO = 13
    VAR = 14
    DATASEC = 15
    FLOAT = 16
    DECL_TAG = 17
    TYPE_TAG = 18
    ENUM64 = 19


# Bytes that follow the common 12-byte record: a fixed part, and a part per vlen item.
_EXTRA_FIXED = {Kind.INT: 4, Kind.ARRAY: 12, Kind.VAR: 4, Kind.DECL_TAG: 4}
_EXTRA_PER_ITEM = {
    Kind.STRUCT: 12, Kind.UNION: 12, Kind.ENUM: 8, Kind.FUNC_PROTO: 8, Kind.DATASEC: 12,
    Kind.ENUM64: 12,
}  # fmt: skip
_MODIFIERS = frozenset({Kind.TYPEDEF, Kind.VOLATILE, Kind.CONST, Kind.RESTRICT, Kind.TYPE_TAG})
_COMPOSITE = frozenset({Kind.STRUCT, Kind.UNION})


@dataclass(frozen=True, slots=True)
class BtfType:
    """One type record. ``ref`` is the record's size (INT, STRUCT, UNION, ENUM, DATASEC, FLOAT)
    or the type it refers to (PTR, TYPEDEF, modifiers, FUNC, VAR, DECL_TAG), as its kind says."""

    id: int
    kind: Kind
    name: str
    vlen: int
    kind_flag: bool
    ref: int


@dataclass(frozen=True, slots=True)
class Member:
    """A struct or union member: ``bit_offset`` from the start of its container; a bitfield has
    ``bitfield_size`` > 0. ``offset`` is in bytes."""

    name: str
    type_id: int
    bit_offset: int
    bitfield_size: int = 0

    @property
    def offset(self) -> int:
        return self.bit_offset // 8


@dataclass(frozen=True, slots=True)
class BtfIndex:
    """Where each type record starts in the section (``starts[id]``, 0 for void) and its kind
    (``kinds[id]``): what loading computes from the type section, valid for the same bytes.
    ``names``: for some kinds, each name's first type id (``Btf.with_names`` fills it)."""

    starts: array[int]  # typecode "I"
    kinds: bytes
    names: dict[int, dict[bytes, int]] = field(default_factory=dict)


class Btf:
    """The types of one ``.BTF`` section, by id and by name."""

    def __init__(self, data: bytes, index: BtfIndex | None = None) -> None:
        """``index``: the section's own ``index`` from an earlier load (a cache); one that does
        not fit the section raises BtfError."""
        if len(data) < _HEADER.size:
            raise BtfError("shorter than its header")
        magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(
            data
        )
        if magic != MAGIC:
            raise BtfError(f"bad magic {magic:#06x} (byte-swapped BTF is not read)")
        if version != 1:
            raise BtfError(f"version {version}, not 1")
        types_at, strings_at = hdr_len + type_off, hdr_len + str_off
        if types_at + type_len > len(data) or strings_at + str_len > len(data):
            raise BtfError("a section runs past the end of the data")
        self._data = data
        self._strings = data[strings_at : strings_at + str_len]
        if index is None:
            index = self._build_index(types_at, types_at + type_len)
        elif not _fits(index, types_at, type_len):
            raise BtfError("an index that does not fit the type section")
        self.index = index
        self._starts = index.starts
        # kind -> name -> first id: built when first asked for, or handed over by the index
        self._names: dict[int, dict[bytes, int]] = dict(index.names)
        self._types: Memo[int, BtfType] = Memo()
        self._members: Memo[int, tuple[Member, ...]] = Memo()

    @classmethod
    def from_image(cls, image: ElfImage) -> Btf | None:
        """The kernel image's BTF, None when it has no ``.BTF`` section."""
        data = image.section(".BTF")
        return None if data is None else cls(data)

    def _build_index(self, pos: int, end: int) -> BtfIndex:
        """Where each type record starts and its kind; index = type id (0, void, has no
        record)."""
        starts, kinds = array("I", [0]), bytearray(1)
        data, unpack = self._data, _U32.unpack_from
        fixed, per_item = _EXTRA_FIXED.get, _EXTRA_PER_ITEM.get
        while pos < end:
            if pos + 12 > end:
                break  # said below: the last record runs past the section
            starts.append(pos)
            info = unpack(data, pos + 4)[0]
            kind = (info >> 24) & 0x1F
            kinds.append(kind)
            pos += 12 + fixed(kind, 0) + per_item(kind, 0) * (info & 0xFFFF)
            if kind > Kind.ENUM64:
                raise BtfError(f"type {len(starts) - 1}: unknown kind {kind}")
        if pos != end:
            raise BtfError("the last type record runs past the type section")
        return BtfIndex(starts, bytes(kinds))

    def __len__(self) -> int:
        """The number of types, void excluded (the largest id)."""
        return len(self._starts) - 1

    def string(self, offset: int) -> str:
        end = self._strings.find(b"\0", offset)
        return self._strings[offset : end if end >= 0 else None].decode("utf-8", "replace")

    def type(self, type_id: int) -> BtfType:
        """The record of ``type_id``; id 0 is void. Raises KeyError for an unknown id."""
        found = self._types.get(type_id)
        if found is not None:
            return found
        if type_id == 0:
            return self._types.put(0, BtfType(0, Kind.VOID, "void", 0, False, 0))
        if not 0 < type_id < len(self._starts):
            raise KeyError(f"no BTF type {type_id}")
        name_off, info, ref = self._unpack(_TYPE, self._starts[type_id])
        raw_kind = (info >> 24) & 0x1F
        if raw_kind != self.index.kinds[type_id] or raw_kind > Kind.ENUM64:
            raise BtfError(f"type {type_id}: kind {raw_kind}, not the one indexed")
        kind = Kind(raw_kind)
        record = BtfType(type_id, kind, self.string(name_off), info & 0xFFFF, bool(info >> 31), ref)
        return self._types.put(type_id, record)

    def _unpack(self, layout: struct.Struct, pos: int) -> tuple[int, ...]:
        """A record's fields at ``pos``; BtfError when they run past the data."""
        if not 0 <= pos <= len(self._data) - layout.size:
            raise BtfError(f"a record at {pos:#x} runs past the section")
        return layout.unpack_from(self._data, pos)

    def _names_of(self, kind: Kind) -> dict[bytes, int]:
        """Name -> the first type id of that name, for one kind (built on first use: a kernel
        has 60 000 named types, most of them functions that qmpprof never looks up)."""
        names = self._names.get(kind)
        if names is None:
            names = self._names[kind] = {}
            strings, find, starts = self._strings, self._strings.find, self._starts
            for found in re.finditer(re.escape(bytes([kind])), self.index.kinds):
                type_id = found.start()
                name_off = self._unpack(_U32, starts[type_id])[0]
                if name_off:
                    names.setdefault(strings[name_off : find(b"\0", name_off)], type_id)
        return names

    def with_names(self, kinds: tuple[Kind, ...]) -> BtfIndex:
        """This section's index with the name index of ``kinds`` (for a cache)."""
        names = {int(kind): self._names_of(kind) for kind in kinds}
        return BtfIndex(self.index.starts, self.index.kinds, names)

    def find(self, name: str, *kinds: Kind) -> int | None:
        """The id of the type named ``name`` of the first of ``kinds`` that has one (by default
        a struct, a union, then a typedef)."""
        key = name.encode()
        for kind in kinds or (Kind.STRUCT, Kind.UNION, Kind.TYPEDEF):
            found = self._names_of(kind).get(key)
            if found is not None:
                return found
        return None

    def struct(self, name: str) -> BtfType:
        """The struct (or union) named ``name``. Raises KeyError."""
        found = self.find(name, Kind.STRUCT, Kind.UNION)
        if found is None:
            raise KeyError(f"no struct {name} in BTF")
        return self.type(found)

    def resolve(self, type_id: int) -> BtfType:
        """The type under typedefs, const, volatile, restrict and type tags."""
        record = self.type(type_id)
        for _ in range(64):  # a cycle is malformed BTF, not a reason to hang
            if record.kind not in _MODIFIERS:
                return record
            record = self.type(record.ref)
        raise BtfError(f"type {type_id}: a cycle of typedefs or modifiers")

    def members(self, type_id: int) -> tuple[Member, ...]:
        """The members of a struct or union (its own, anonymous ones not opened)."""
        found = self._members.get(type_id)
        if found is not None:
            return found
        record = self.type(type_id)
        if record.kind not in _COMPOSITE:
            raise KeyError(f"type {type_id} ({record.name or 'anonymous'}) is a {record.kind.name}")
        pos = self._starts[type_id] + 12
        raw = self._data[pos : pos + 12 * record.vlen]
        if len(raw) != 12 * record.vlen:
            raise BtfError(f"type {type_id}: its members run past the section")
        out = []
        for name_off, member_type, offset in _MEMBER.iter_unpack(raw):
            if record.kind_flag:
                out.append(
                    Member(self.string(name_off), member_type, offset & 0xFFFFFF, offset >> 24)
                )
            else:
                out.append(Member(self.string(name_off), member_type, offset))
        return self._members.put(type_id, tuple(out))

    def member(self, type_id: int, name: str) -> Member:
        """The member ``name`` of a struct or union, searched through its anonymous structs and
        unions too; its offset is from the start of ``type_id``. Raises KeyError."""
        found = self._search(type_id, name, 0)
        if found is None:
            raise KeyError(f"no member {name} in {self.type(type_id).name or 'anonymous'}")
        return found

    def _search(self, type_id: int, name: str, base_bits: int, depth: int = 0) -> Member | None:
        if depth > _MAX_NESTING:
            raise BtfError(f"type {type_id}: anonymous members nested in a cycle")
        anonymous = []
        for m in self.members(type_id):
            if m.name == name:
                return Member(m.name, m.type_id, base_bits + m.bit_offset, m.bitfield_size)
            if not m.name:
                anonymous.append(m)
        for m in anonymous:
            inner = self.resolve(m.type_id)
            if inner.kind in _COMPOSITE:
                found = self._search(inner.id, name, base_bits + m.bit_offset, depth + 1)
                if found is not None:
                    return found
        return None

    def field(self, path: str) -> Member:
        """A member by ``struct.member[.member...]`` (``task_struct.thread.sp``): each step
        into the previous member's struct or union type, pointers not followed. The result's
        offset is from the start of the first struct. Raises KeyError."""
        first, *names = path.split(".")
        if not names:
            raise KeyError(f"{path}: a path is struct.member")
        current = self.struct(first)
        bits = 0
        member = None
        for name in names:
            if member is not None:
                current = self.resolve(member.type_id)
                if current.kind not in _COMPOSITE:
                    raise KeyError(f"{path}: {member.name} is not a struct or union")
            member = self.member(current.id, name)
            bits += member.bit_offset
        assert member is not None
        return Member(member.name, member.type_id, bits, member.bitfield_size)

    def offset_of(self, path: str) -> int:
        """The byte offset of ``struct.member[.member...]``."""
        return self.field(path).offset

    def size_of(self, type_id: int, depth: int = 0) -> int:
        """The size in bytes of a type (pointers are 8 bytes: x86_64 kernels)."""
        if depth > _MAX_NESTING:
            raise BtfError(f"type {type_id}: an array of itself")
        record = self.resolve(type_id)
        kind = record.kind
        if kind in (Kind.INT, Kind.STRUCT, Kind.UNION, Kind.ENUM, Kind.ENUM64, Kind.FLOAT):
            return record.ref
        if kind is Kind.PTR:
            return 8
        if kind is Kind.ARRAY:
            element, count = self.array(record.id)
            return count * self.size_of(element, depth + 1)
        raise KeyError(f"type {type_id} ({kind.name}) has no size")

    def array(self, type_id: int) -> tuple[int, int]:
        """(element type id, number of elements) of an array type (through typedefs)."""
        record = self.resolve(type_id)
        if record.kind is not Kind.ARRAY:
            raise KeyError(f"type {type_id} is a {record.kind.name}, not an array")
        element, _index, count = self._unpack(_ARRAY, self._starts[record.id] + 12)
        return element, count

    def enum_values(self, type_id: int) -> dict[str, int]:
        """The enumerators of an ENUM or ENUM64 type (signed when its kind_flag says so)."""
        record = self.resolve(type_id)
        pos = self._starts[record.id] + 12
        values = {}
        if record.kind is Kind.ENUM:
            item = _ENUM_SIGNED if record.kind_flag else _ENUM
            for i in range(record.vlen):
                name_off, value = self._unpack(item, pos + 8 * i)
                values[self.string(name_off)] = value
        elif record.kind is Kind.ENUM64:
            for i in range(record.vlen):
                name_off, low, high = self._unpack(_ENUM64, pos + 12 * i)
                value = high << 32 | low
                if record.kind_flag and value >> 63:
                    value -= 1 << 64
                values[self.string(name_off)] = value
        else:
            raise KeyError(f"type {type_id} is a {record.kind.name}, not an enum")
        return values

    def datasec(self, name: str) -> dict[str, tuple[int, int]]:
        """A DATASEC's variables: name -> (offset in the section, type id)."""
        found = self.find(name, Kind.DATASEC)
        if found is None:
            raise KeyError(f"no data section {name} in BTF")
        record = self.type(found)
        pos = self._starts[found] + 12
        data, starts, strings, find = self._data, self._starts, self._strings, self._strings.find
        out = {}
        # Thousands of per-CPU variables: read straight from the records, no BtfType each.
        raw = data[pos : pos + 12 * record.vlen]
        if len(raw) != 12 * record.vlen:
            raise BtfError(f"data section {name}: its variables run past the section")
        for var_id, offset, _size in _SECINFO.iter_unpack(raw):
            if not 0 < var_id < len(starts):
                raise KeyError(f"no BTF type {var_id}")
            name_off, _info, var_type = self._unpack(_TYPE, starts[var_id])
            var_name = strings[name_off : find(b"\0", name_off)].decode("utf-8", "replace")
            out[var_name] = (offset, var_type)
        return out

    def percpu(self, name: str) -> tuple[int, int]:
        """(offset, type id) of a per-CPU variable (``.data..percpu``): add a CPU's per-CPU
        base to the offset. Raises KeyError."""
        try:
            return self._percpu[name]
        except KeyError:
            raise KeyError(f"no per-CPU variable {name} in BTF") from None

    @cached_property
    def _percpu(self) -> dict[str, tuple[int, int]]:
        return self.datasec(".data..percpu")


def _fits(index: BtfIndex, types_at: int, type_len: int) -> bool:
    """Whether a cached index can be this section's: one known kind per start, the first and
    the last record inside the type section (the records between are not walked again)."""
    starts, kinds = index.starts, index.kinds
    if starts.typecode != "I" or len(starts) != len(kinds) or not starts or starts[0] or kinds[0]:
        return False
    inside = len(starts) == 1 or (starts[1] == types_at and starts[-1] + 12 <= types_at + type_len)
    return inside and max(kinds) <= Kind.ENUM64 and _names_fit(index)


def _names_fit(index: BtfIndex) -> bool:
    """Whether every id a name index gives is a type of its kind."""
    kinds = index.kinds
    return all(
        0 < type_id < len(kinds) and kinds[type_id] == kind
        for kind, names in index.names.items()
        for type_id in names.values()
    )
