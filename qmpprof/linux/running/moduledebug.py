"""A loaded module's source lines from its debug file, fetched by build-id from debuginfod
servers, its DWARF placed where the guest loaded each of its sections.

The kernel keeps what ``/sys/module/NAME/notes`` and ``/sys/module/NAME/sections`` show:
``struct module``'s ``notes_attrs`` (each note section's bytes: a ``bin_attribute``'s
``private`` and ``size``) and ``sect_attrs`` (each section's name and address:
``module_sect_attr.address`` in 6.12, ``bin_attribute.private`` in 7.2; a count beside the list
in 6.12, the list's ``grp.bin_attrs`` NULL-terminated in 7.2); which it is, BTF says. The
build-id is the ``.note.gnu.build-id`` section's GNU note.

A ``.ko`` is relocatable: its DWARF names code by section and offset, and the loader placed
each section. The debug file's symbols are moved to where the guest put their sections (as
the loader's ``simplify_symbols`` does) before pyelftools applies the DWARF's relocations, so
that its lines answer the guest's own addresses.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from qmpprof.elf.image import ElfImage, gnu_build_id
from qmpprof.elf.lines import LineTable
from qmpprof.errors import ElfError
from qmpprof.linux.btf import Btf
from qmpprof.memory import Reader, read_ints, read_one
from qmpprof.pagecache import PAGE

MAX_ATTRS = 1024  # sections of one module read at most (a large one has a few hundred)
_NAME_MAX = 128  # bytes of a section's name read at most
_NOTES_MAX = 4096  # bytes of a note section read at most
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym: name, info, other, shndx, value, size
_SHF_ALLOC = 0x2
_BUILD_ID = ".note.gnu.build-id"


def debuginfod_asked() -> bool:
    """Whether debuginfod servers are named (``DEBUGINFOD_URLS``): a run that asks none
    reads no module's build-id and sections."""
    return bool(os.environ.get("DEBUGINFOD_URLS", "").split())


@dataclass(frozen=True, slots=True)
class AttrList:
    """One of ``struct module``'s lists of sysfs attributes (``sect_attrs``, ``notes_attrs``)."""

    pointer: int  # the list's pointer in struct module
    count: int | None  # its count (unsigned int) in the list; None: ``pointers`` ends in NULL
    pointers: int  # grp.bin_attrs in the list, where there is no count
    first: int  # attrs[0] in the list
    stride: int  # the size of an element
    battr: int  # its bin_attribute in an element
    address: int | None  # a section's address in an element; None: bin_attribute.private

    @classmethod
    def from_btf(cls, btf: Btf, member: str, name: str, count: str) -> AttrList:
        """Raises KeyError naming what this kernel's BTF lacks."""
        attrs = btf.field(f"{name}.attrs")
        element = btf.resolve(btf.array(attrs.type_id)[0])
        counted, pointers = None, 0
        try:
            counted = btf.offset_of(f"{name}.{count}")
        except KeyError:
            pointers = btf.offset_of(f"{name}.grp.bin_attrs")
        battr, address = 0, None
        if element.name != "bin_attribute":
            battr = btf.member(element.id, "battr").offset
            address = btf.member(element.id, "address").offset
        return cls(
            btf.offset_of(f"module.{member}"), counted, pointers, attrs.offset,
            btf.size_of(element.id), battr, address,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DebugLayout:
    sections: AttrList
    notes: AttrList
    name: int  # bin_attribute.attr.name
    size: int  # bin_attribute.size
    private: int  # bin_attribute.private

    @classmethod
    def from_btf(cls, btf: Btf) -> DebugLayout:
        """Raises KeyError naming what this kernel's BTF lacks."""
        return cls(
            AttrList.from_btf(btf, "sect_attrs", "module_sect_attrs", "nsections"),
            AttrList.from_btf(btf, "notes_attrs", "module_notes_attrs", "notes"),
            btf.offset_of("bin_attribute.attr.name"),
            btf.offset_of("bin_attribute.size"),
            btf.offset_of("bin_attribute.private"),
        )


@dataclass(frozen=True, slots=True)
class Attr:
    name: str
    size: int
    value: int  # a section's address, or where a note section's bytes are


async def _elements(read: Reader, module: int, attrs: AttrList) -> list[int]:
    """Where the elements of one list are (empty where it cannot be read)."""
    (base,) = await read_ints(read, [(module + attrs.pointer, 8)])
    if not base:
        return []
    if attrs.count is not None:
        (count,) = await read_ints(read, [(base + attrs.count, 4)])
        count = min(count or 0, MAX_ATTRS)
        return [base + attrs.first + i * attrs.stride for i in range(count)]
    (array,) = await read_ints(read, [(base + attrs.pointers, 8)])
    if not array:
        return []
    # A kmalloc'd array up to a page does not cross a page: read to the page's end.
    raw = await read_one(read, array, min(8 * (MAX_ATTRS + 1), PAGE - array % PAGE))
    if raw is None:
        return []
    out = []
    for (pointer,) in struct.iter_unpack("<Q", raw[: len(raw) // 8 * 8]):
        if not pointer:
            break
        out.append(pointer - attrs.battr)
    return out


async def read_attrs(read: Reader, module: int, layout: DebugLayout, notes: bool) -> list[Attr]:
    """A module's sections (``notes``: its note sections) as sysfs shows them."""
    attrs = layout.notes if notes else layout.sections
    out = []
    for element in await _elements(read, module, attrs):
        battr = element + attrs.battr
        fields = [(battr + layout.name, 8), (battr + layout.size, 8), (battr + layout.private, 8)]
        if attrs.address is not None:
            fields.append((element + attrs.address, 8))
        name_at, size, *values = await read_ints(read, fields)
        value = values[-1]
        if not name_at or size is None or value is None:
            continue
        raw = await read_one(read, name_at, min(_NAME_MAX, PAGE - name_at % PAGE))
        if raw is not None:
            out.append(Attr(raw.split(b"\0", 1)[0].decode("utf-8", "replace"), size, value))
    return out


async def build_id(read: Reader, module: int, layout: DebugLayout) -> str | None:
    """The module's build-id, from its ``.note.gnu.build-id`` section in guest memory."""
    for attr in await read_attrs(read, module, layout, notes=True):
        if attr.name == _BUILD_ID and attr.value:
            found = await read_one(read, attr.value, min(attr.size, _NOTES_MAX))
            return None if found is None else gnu_build_id(found)
    return None


def placed(debug: ElfImage, sections: dict[str, int]) -> ElfImage:
    """The relocatable ``debug`` with the symbols of each allocated section named in
    ``sections`` moved to that section's address there. Raises ElfError."""
    symtab = debug.section_header(".symtab")
    if symtab is None or symtab.nobits:
        raise ElfError(debug.path, "no symbol table: its DWARF cannot be placed")
    headers = debug.section_headers()
    moved = [sections.get(h.name, 0) if h.flags & _SHF_ALLOC else 0 for h in headers]
    data = bytearray(debug.file_bytes(0, debug.size))
    for at in range(symtab.offset, symtab.offset + symtab.size - _SYM.size + 1, _SYM.size):
        name, info, other, shndx, value, size = _SYM.unpack_from(data, at)
        if shndx < len(moved) and moved[shndx]:
            _SYM.pack_into(data, at, name, info, other, shndx, value + moved[shndx], size)
    return ElfImage.from_bytes(debug.path, bytes(data))


async def module_lines(
    read: Reader, module: int, name: str, layout: DebugLayout, notes: list[str]
) -> LineTable | None:
    """The lines of the module at ``module`` from its debug file (debuginfod's), placed where
    the guest loaded it; None and a line in ``notes`` where a server was asked and none had
    it."""
    found = await build_id(read, module, layout)
    if found is None:
        return None
    # Imported here: its HTTP client (http.client, email) serves this case alone.
    from qmpprof.elf import debuginfod

    debug, note = debuginfod.debug_image(found, f"module {name}")
    if debug is None:
        notes += [] if note is None else [note]
        return None
    sections = {a.name: a.value for a in await read_attrs(read, module, layout, notes=False)}
    try:
        return placed(debug, sections).lines
    except ElfError as err:
        notes.append(f"debuginfod: module {name}: {err}")
        return None
