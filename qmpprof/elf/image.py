"""ElfImage: what qmpprof needs from one x86_64 or i386 ELF file — text, symbols, CFI, identity.

The headers (file, program and section headers) are read here with ``struct``: that is all a
load needs, and it takes a millisecond where pyelftools takes tens of them to import and parse.
pyelftools, the only module importing it, is imported on first use of DWARF (``lines``). Bulk
data is read directly from the file bytes: symbol tables with ``struct.iter_unpack`` (pyelftools
decodes one symbol at a time, which costs seconds on a binary with 100 000 symbols), CFI by
``qmpprof.dwarf.cfi``. Symbols, CFI and the text hash are built on first use, so loading a large
ELF is cheap; ``load(path, mapped=True)`` maps the file instead of reading it, for a 60 MB
vmlinux of which a run reads a few sections. Every problem with the file becomes an
``ElfError`` with a one-line reason.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from qmpprof import arch as arches
from qmpprof.arch.base import InstructionSet
from qmpprof.dwarf.cfi import CfiTable
from qmpprof.elf.lines import LineTable
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.errors import ElfError

_SYM64 = struct.Struct("<IBBHQQ")  # Elf64_Sym: name, info, other, shndx, value, size
_SYM32 = struct.Struct("<IIIBBH")  # Elf32_Sym: name, value, size, info, other, shndx
# The file header after e_ident, up to e_shstrndx: type, machine, version, entry, phoff, shoff,
# flags, ehsize, phentsize, phnum, shentsize, shnum, shstrndx.
_EHDR = {64: struct.Struct("<HHIQQQIHHHHHH"), 32: struct.Struct("<HHIIIIIHHHHHH")}
# Section headers: name, type, flags, addr, offset, size, link, info (alignment, entsize unread).
_SHDR = {64: struct.Struct("<IIQQQQII16x"), 32: struct.Struct("<IIIIIIII8x")}
# Program headers: (type, offset, vaddr, memsz, paddr) at these field indexes of each class's order.
_PHDR = {64: struct.Struct("<IIQQQQQQ"), 32: struct.Struct("<IIIIIIII")}
_PHDR_FIELDS = {64: (0, 2, 3, 6, 4), 32: (0, 1, 2, 5, 3)}
_ET_EXEC = 2
_PT_LOAD, _SHT_NOTE, _SHT_NOBITS = 1, 7, 8
_SHF_ALLOC, _SHF_EXECINSTR = 0x2, 0x4
_STT_NOTYPE, _STT_FUNC = 0, 2
_STB_RANK = {1: 0, 2: 1, 0: 2}  # GLOBAL, WEAK, LOCAL: which alias names a shared address
_SHN_UNDEF, _SHN_LORESERVE, _SHN_ABS, _SHN_XINDEX = 0, 0xFF00, 0xFFF1, 0xFFFF

Data = bytes | mmap.mmap  # a file's bytes, read or mapped: both slice into bytes


@dataclass(frozen=True, slots=True)
class SectionHeader:
    """The fields of one section header qmpprof reads."""

    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int

    @property
    def nobits(self) -> bool:
        return self.type == _SHT_NOBITS


@dataclass(frozen=True, slots=True)
class _Headers:
    arch: InstructionSet
    entry: int | None  # e_entry, None where the file names no entry point
    sections: list[SectionHeader]
    loads: list[tuple[int, int, int]]  # PT_LOAD segments: (vaddr, file offset, memsz)
    physical: list[tuple[int, int]]  # PT_LOAD segments' physical ranges: (start, end)


class ElfImage:
    """One ELF file, loaded with ``ElfImage.load(path)``."""

    def __init__(self, path: str, data: Data, headers: _Headers) -> None:
        self.path = path
        self.arch = headers.arch  # the instruction set: DWARF register numbers, address size
        self.name = _module_name(path)
        self._data = data
        self.size = len(data)  # of the file, in bytes
        self._section_list = headers.sections
        self._sections: dict[str, SectionHeader] = {}
        for header in headers.sections:
            self._sections.setdefault(header.name, header)
        if headers.loads:
            low, offset, _ = min(headers.loads)
            high = max(vaddr + memsz for vaddr, _, memsz in headers.loads)
        else:
            low = high = offset = 0
        self.load_range: tuple[int, int] = (low, high)
        self.load_offset: int = offset  # the file offset of load_range's start
        # Where the segments are loaded in physical memory (p_paddr): a kernel's code runs
        # there before it turns paging on.
        self.physical_ranges: tuple[tuple[int, int], ...] = tuple(headers.physical)
        self._moves = tuple(
            (vaddr, vaddr + memsz, start - vaddr)
            for (vaddr, _, memsz), (start, _) in zip(headers.loads, headers.physical, strict=True)
        )
        self.entry: int | None = headers.entry
        text = self._sections.get(".text")
        self.text_addr: int = text.addr if text is not None else 0
        self.text_size: int = text.size if text is not None else 0
        self.build_id = self._build_id()
        # A separate debug file of this one (debuginfod's, by build-id), set before the first
        # use of ``symbols`` or ``lines``: its DWARF and symbol table stand in for those the
        # file lacks (stripped).
        self.debug: ElfImage | None = None

    @classmethod
    def load(cls, path: str | Path, *, mapped: bool = False) -> ElfImage:
        """Read and check an x86_64 or i386 ELF file; raises ElfError, never anything else.
        ``mapped``: map the file rather than read it (sections are read when asked for)."""
        text = str(path)
        try:
            with open(path, "rb") as f:
                data: Data = _map(f) if mapped else f.read()
        except OSError as err:
            raise ElfError(text, err.strerror or str(err)) from err
        return cls.from_bytes(text, data)

    @classmethod
    def from_bytes(cls, path: str, data: Data) -> ElfImage:
        """Check an x86_64 or i386 ELF held in memory (a vmlinux unpacked from a bzImage) or
        mapped; ``path`` names it in errors. Raises ElfError, never anything else."""
        if data[:4] != b"\x7fELF":
            raise ElfError(path, "no ELF magic")
        try:
            image = cls(path, data, _headers(path, data))
        except ElfError:
            raise
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as err:
            raise ElfError(path, f"malformed ({type(err).__name__}: {err})") from err
        image._check_bounds()
        return image

    def _check_bounds(self) -> None:
        for header in self._section_list:
            if not header.nobits and header.offset + header.size > len(self._data):
                raise ElfError(self.path, "truncated (a section runs past the end of the file)")

    def section(self, name: str) -> bytes | None:
        """The bytes of a section, or None if it is absent or has no file contents (NOBITS)."""
        header = self._sections.get(name)
        if header is None or header.nobits:
            return None
        return self._data[header.offset : header.offset + header.size]

    def has_section(self, name: str) -> bool:
        """Whether ``section(name)`` has bytes, without copying them (a debug vmlinux's
        .debug_info is some 200 MB)."""
        header = self._sections.get(name)
        if header is None or header.nobits:
            return False
        return header.size > 0 and header.offset < len(self._data)

    def section_header(self, name: str) -> SectionHeader | None:
        return self._sections.get(name)

    def section_headers(self) -> list[SectionHeader]:
        """Every section header, by its index (a symbol's ``st_shndx``)."""
        return list(self._section_list)

    def file_bytes(self, offset: int, size: int) -> bytes:
        """The file's bytes at ``offset`` (fewer at its end)."""
        return self._data[offset : offset + size]

    def section_addr(self, name: str) -> int | None:
        header = self._sections.get(name)
        return None if header is None else header.addr

    def code_ranges(self) -> list[tuple[int, int]]:
        """(start, end) addresses of every executable section."""
        return [(h.addr, h.addr + h.size) for h in self._section_list if h.flags & _SHF_EXECINSTR]

    def physical(self, addr: int) -> int | None:
        """Where link address ``addr`` is loaded in physical memory (its segment's p_paddr);
        None when no segment holds it."""
        for lo, hi, move in self._moves:
            if lo <= addr < hi:
                return addr + move
        return None

    def code_at(self, addr: int, size: int) -> bytes | None:
        """The file's bytes of an executable section at link address ``addr`` (None when no
        such section holds all ``size`` of them)."""
        for h in self._section_list:
            code = h.flags & _SHF_EXECINSTR and not h.nobits
            if code and h.addr <= addr <= h.addr + h.size - size:
                at = h.offset + addr - h.addr
                return bytes(self._data[at : at + size])
        return None

    def prepare(self) -> ElfImage:
        """Everything a sample may need, built now rather than inside the first pause: the
        symbol table, the CFI index, the ``.text`` hash."""
        _ = self.symbols, self.text_sha256
        if self.cfi is not None:
            self.cfi.prepare()
        return self

    @cached_property
    def text_bytes(self) -> bytes:
        # One bytes object per image: every Module built from it shares it (and its hash).
        return self.section(".text") or b""

    @cached_property
    def function_starts(self) -> list[int]:
        """Where functions of ``.text`` may start, for code with no symbols and no CFI: the
        instruction set's guess from the code and the allocated, non-executable sections."""
        data = [
            self._data[h.offset : h.offset + h.size]
            for h in self._section_list
            if h.flags & _SHF_ALLOC and not h.flags & _SHF_EXECINSTR and not h.nobits
        ]
        return self.arch.function_starts(self.text_bytes, self.text_addr, data)

    @cached_property
    def text_sha256(self) -> str:
        return hashlib.sha256(self.text_bytes).hexdigest()

    @cached_property
    def symbols(self) -> SymbolTable:
        symbols = self._read_symbols(".symtab")
        if not symbols and self.debug is not None:
            symbols = self.debug._read_symbols(".symtab")
        return SymbolTable(symbols + self._read_symbols(".dynsym"))

    @cached_property
    def cfi(self) -> CfiTable | None:
        eh = self.section(".eh_frame")
        if eh:
            return CfiTable.parse(
                eh,
                self.section_addr(".eh_frame") or 0,
                hdr=self.section(".eh_frame_hdr"),
                hdr_addr=self.section_addr(".eh_frame_hdr") or 0,
                address_size=self.arch.address_size,
            )
        debug = self.section(".debug_frame")
        if debug:
            return CfiTable.parse(debug, 0, kind="debug_frame", address_size=self.arch.address_size)
        return None

    @cached_property
    def lines(self) -> LineTable | None:
        """Source lines and inlined frames (DWARF: the file's own, else its ``debug`` file's),
        decoded on first lookup; None without DWARF."""
        if self.has_section(".debug_line"):
            return LineTable(self._dwarf)
        return None if self.debug is None else self.debug.lines

    def dwarf_info(self) -> Any:
        """pyelftools' DWARFInfo, for the readers of its DIEs in this package; None without
        DWARF."""
        return self._dwarf() if self.has_section(".debug_info") else None

    def location_exprs(self, die: Any, attr: Any) -> list[bytes]:
        """The DWARF expressions of a location attribute of ``die``: the one of an exprloc, or
        a location list's, in the list's order."""
        from elftools.dwarf.locationlists import LocationEntry, LocationParser

        if attr.form == "DW_FORM_exprloc":
            return [bytes(attr.value)]
        dwarf = die.dwarfinfo
        parsed = LocationParser(dwarf.location_lists()).parse_from_attribute(
            attr, die.cu["version"], die
        )
        return [bytes(e.loc_expr) for e in parsed if isinstance(e, LocationEntry)]

    def _dwarf(self) -> Any:
        from elftools.elf.elffile import ELFFile  # only DWARF needs pyelftools: imported late

        # A mapped file is a stream itself: no copy of a 600 MB debug vmlinux.
        data = self._data
        stream: Any = data if isinstance(data, mmap.mmap) else io.BytesIO(data)  # both read+seek
        elf = ELFFile(stream)
        return elf.get_dwarf_info() if elf.has_dwarf_info() else None

    def _read_symbols(self, name: str) -> list[Symbol]:
        header = self._sections.get(name)
        data = self.section(name)
        if header is None or data is None or header.link >= len(self._section_list):
            return []
        strtab_header = self._section_list[header.link]
        start = strtab_header.offset
        strtab = self._data[start : start + strtab_header.size]
        executable = {i for i, h in enumerate(self._section_list) if h.flags & _SHF_EXECINSTR}
        out: list[Symbol] = []
        for st_name, info, shndx, value, size in self._raw_symbols(data):
            kind = info & 0xF
            if shndx == _SHN_UNDEF or not st_name:
                continue
            # Assembly entry stubs are often NOTYPE labels: keep those that sit in code.
            code = kind == _STT_FUNC or (kind == _STT_NOTYPE and shndx in executable)
            if not code or (shndx >= _SHN_LORESERVE and shndx != _SHN_ABS):
                continue
            end = strtab.find(b"\0", st_name)
            label = strtab[st_name : end if end >= 0 else len(strtab)].decode("utf-8", "replace")
            if label.startswith(".L") or label.startswith("$"):
                continue  # local assembler labels and ARM-style mapping symbols
            out.append(Symbol(value, size, label, _STB_RANK.get(info >> 4, 3)))
        return out

    def _raw_symbols(self, data: bytes) -> list[tuple[int, int, int, int, int]]:
        """(name, info, shndx, value, size) of every entry of a symbol table's bytes."""
        if self.arch.address_size == 8:
            usable = len(data) - len(data) % _SYM64.size
            return [(n, i, x, v, z) for n, i, _, x, v, z in _SYM64.iter_unpack(data[:usable])]
        usable = len(data) - len(data) % _SYM32.size
        return [(n, i, x, v, z) for n, v, z, i, _, x in _SYM32.iter_unpack(data[:usable])]

    def _build_id(self) -> str | None:
        """The GNU build-id note, in whichever note section holds it: ``.note.gnu.build-id``
        in programs, Linux's ``.notes`` (beside its Xen notes) in a vmlinux."""
        for header in self._sections.values():
            if header.type == _SHT_NOTE and not header.nobits:
                found = gnu_build_id(self._data[header.offset : header.offset + header.size])
                if found is not None:
                    return found
        return None


def gnu_build_id(notes: bytes) -> str | None:
    """The descriptor of the first NT_GNU_BUILD_ID note named "GNU" in a run of notes."""
    at = 0
    while at + 12 <= len(notes):
        namesz, descsz, note_type = struct.unpack_from("<III", notes, at)
        name_at = at + 12
        desc_at = name_at + (namesz + 3) // 4 * 4
        end = desc_at + (descsz + 3) // 4 * 4
        if desc_at + descsz > len(notes):
            return None
        if note_type == 3 and notes[name_at : name_at + namesz].rstrip(b"\0") == b"GNU":
            return notes[desc_at : desc_at + descsz].hex() if descsz else None
        at = end
    return None


_KIND_SUFFIXES = (".elf", ".ko", ".o")


def _module_name(path: str) -> str:
    """The name frames give a file's code: its file name, less a suffix that only says what
    the file is (``kernel.elf``, ``qmpprof_burn.ko``); whole otherwise, for the version a
    shared object or a program carries in its suffixes (``liblzma.so.5.4.1`` and
    ``libc.so.6``, not ``liblzma.so.5.4`` and ``libc.so``; ``python3.11``)."""
    file = Path(path)
    return file.stem if file.suffix in _KIND_SUFFIXES else file.name


def _map(f: Any) -> Data:
    """The file mapped read-only; an empty file (which cannot be mapped) read."""
    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:
        return bytes(f.read())


def _headers(path: str, data: Data) -> _Headers:
    """The file, section and program headers (``elf.h``), checked against the file's size."""
    bits = {1: 32, 2: 64}.get(data[4])
    if bits is None or data[5] != 1:
        raise ElfError(path, "not a little-endian 32- or 64-bit ELF")
    ehdr = _EHDR[bits]
    if len(data) < 16 + ehdr.size:
        raise ElfError(path, "truncated (shorter than its ELF header)")
    fields = ehdr.unpack_from(data, 16)
    kind, machine, _version, entry, phoff, shoff = fields[:6]
    phentsize, phnum, shentsize, shnum, shstrndx = fields[8:]
    arch = arches.by_elf(machine, bits)
    if arch is None:
        known = ", ".join(arches.names())
        raise ElfError(path, f"{bits}-bit {_machine_name(machine)}: qmpprof reads {known}")
    shdr = _SHDR[bits]
    raw = []
    if shoff:
        first = _table(path, data, shoff, max(shnum, 1), shentsize, shdr)[0]
        if shnum == 0:  # extended numbering: the count lives in section 0
            shnum = first[5]
        if shstrndx == _SHN_XINDEX:
            shstrndx = first[6]
        raw = _table(path, data, shoff, shnum, shentsize, shdr)
    if phnum == _SHN_XINDEX and raw:
        phnum = raw[0][7]
    names = b""
    if raw and shstrndx < len(raw):
        names = bytes(data[raw[shstrndx][4] : raw[shstrndx][4] + raw[shstrndx][5]])
    sections = [
        SectionHeader(_name(names, name), kind, flags, addr, offset, size, link)
        for name, kind, flags, addr, offset, size, link, _info in raw
    ]
    loads, physical = [], []
    if phoff:
        t, o, v, m, p = _PHDR_FIELDS[bits]
        for ph in _table(path, data, phoff, phnum, phentsize, _PHDR[bits]):
            if ph[t] == _PT_LOAD:
                loads.append((ph[v], ph[o], ph[m]))
                physical.append((ph[p], ph[p] + ph[m]))
    # An executable's entry may be 0 (a program linked at 0); a shared object's 0 means none.
    named = kind == _ET_EXEC or entry != 0
    return _Headers(arch, entry if named else None, sections, loads, physical)


def _table(
    path: str, data: Data, offset: int, count: int, entsize: int, entry: struct.Struct
) -> list[tuple[int, ...]]:
    if count and entsize < entry.size:
        raise ElfError(path, f"malformed (header entries of {entsize} bytes)")
    if offset + count * entsize > len(data):
        raise ElfError(path, "truncated (a header table runs past the end of the file)")
    return [entry.unpack_from(data, offset + i * entsize) for i in range(count)]


def _name(names: bytes, offset: int) -> str:
    end = names.find(b"\0", offset)
    return names[offset : end if end >= 0 else len(names)].decode("utf-8", "replace")


def _machine_name(machine: int) -> str:
    """e_machine as elf.h spells it, for an error message (pyelftools has the table)."""
    from elftools.elf.enums import ENUM_E_MACHINE

    names = {v: k for k, v in ENUM_E_MACHINE.items() if isinstance(v, int)}
    return names.get(machine, f"machine {machine}")
