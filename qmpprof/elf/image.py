"""ElfImage: what qmpprof needs from one x86_64 or i386 ELF file — text, symbols, CFI, identity.

The only module that imports pyelftools (for the headers). Bulk data is read directly from
the file bytes: symbol tables with ``struct.iter_unpack`` (pyelftools decodes one symbol at a
time, which costs seconds on a binary with 100 000 symbols), CFI by ``qmpprof.dwarf.cfi``.
Symbols, CFI and the text hash are built on first use, so loading a large ELF is cheap.
Every problem with the file becomes an ``ElfError`` with a one-line reason.
"""

from __future__ import annotations

import hashlib
import io
import struct
from functools import cached_property
from pathlib import Path
from typing import Any

from elftools.common.exceptions import ELFError as PyElfError
from elftools.elf.elffile import ELFFile

from qmpprof.dwarf.arch import BY_MACHINE, Arch
from qmpprof.dwarf.cfi import CfiTable
from qmpprof.elf.lines import LineTable
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.errors import ElfError

_SYM64 = struct.Struct("<IBBHQQ")  # Elf64_Sym: name, info, other, shndx, value, size
_SYM32 = struct.Struct("<IIIBBH")  # Elf32_Sym: name, value, size, info, other, shndx
_SHF_EXECINSTR = 0x4
_STT_NOTYPE, _STT_FUNC = 0, 2
_STB_RANK = {1: 0, 2: 1, 0: 2}  # GLOBAL, WEAK, LOCAL: which alias names a shared address
_SHN_UNDEF, _SHN_LORESERVE, _SHN_ABS = 0, 0xFF00, 0xFFF1


class ElfImage:
    """One ELF file, loaded with ``ElfImage.load(path)``."""

    def __init__(self, path: str, data: bytes, elf: Any, arch: Arch) -> None:
        self.path = path
        self.arch = arch  # the instruction set: DWARF register numbers, address size
        self.name = Path(path).stem
        self._data = data
        self._sections: dict[str, Any] = {}
        for sec in elf.iter_sections():
            self._sections.setdefault(sec.name, sec.header)
        self._section_list = [sec.header for sec in elf.iter_sections()]
        loads = [seg.header for seg in elf.iter_segments() if seg["p_type"] == "PT_LOAD"]
        if loads:
            first = min(loads, key=lambda h: h["p_vaddr"])
            low, offset = first["p_vaddr"], first["p_offset"]
            high = max(h["p_vaddr"] + h["p_memsz"] for h in loads)
        else:
            low = high = offset = 0
        self.load_range: tuple[int, int] = (low, high)
        self.load_offset: int = offset  # the file offset of load_range's start
        self.entry: int = elf.header["e_entry"]
        text = self._sections.get(".text")
        self.text_addr: int = text["sh_addr"] if text is not None else 0
        self.text_size: int = text["sh_size"] if text is not None else 0
        self.build_id = self._build_id()

    @classmethod
    def load(cls, path: str | Path) -> ElfImage:
        """Read and check an x86_64 or i386 ELF file; raises ElfError, never anything else."""
        text = str(path)
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise ElfError(text, err.strerror or str(err)) from err
        return cls.from_bytes(text, data)

    @staticmethod
    def sniff_arch(path: str | Path) -> Arch | None:
        """The instruction set an ELF file's header names (class and e_machine), without
        parsing the rest; None for anything else or a file that cannot be read."""
        try:
            with open(path, "rb") as f:
                head = f.read(20)
        except OSError:
            return None
        if len(head) < 20 or not head.startswith(b"\x7fELF"):
            return None
        machine = {3: "EM_386", 62: "EM_X86_64"}.get(int.from_bytes(head[18:20], "little"))
        return None if machine is None else BY_MACHINE.get((machine, 32 * head[4]))

    @classmethod
    def from_bytes(cls, path: str, data: bytes) -> ElfImage:
        """Check an x86_64 or i386 ELF held in memory (a vmlinux unpacked from a bzImage);
        ``path`` names it in errors. Raises ElfError, never anything else."""
        if not data.startswith(b"\x7fELF"):
            raise ElfError(path, "no ELF magic")
        try:
            elf = ELFFile(io.BytesIO(data))
            arch = BY_MACHINE.get((elf["e_machine"], elf.elfclass))
            if arch is None:
                raise ElfError(
                    path, f"{elf.elfclass}-bit {elf['e_machine']}, not x86_64 or 32-bit i386"
                )
            image = cls(path, data, elf, arch)
            image._check_bounds()
        except ElfError:
            raise
        except PyElfError as err:
            raise ElfError(path, f"malformed ({err})") from err
        except Exception as err:  # pyelftools reports some corruptions as arbitrary errors
            raise ElfError(path, f"malformed ({type(err).__name__}: {err})") from err
        return image

    def _check_bounds(self) -> None:
        for header in self._section_list:
            if header["sh_type"] != "SHT_NOBITS" and header["sh_offset"] + header["sh_size"] > len(
                self._data
            ):
                raise ElfError(self.path, "truncated (a section runs past the end of the file)")

    def section(self, name: str) -> bytes | None:
        """The bytes of a section, or None if it is absent or has no file contents (NOBITS)."""
        header = self._sections.get(name)
        if header is None or header["sh_type"] == "SHT_NOBITS":
            return None
        start: int = header["sh_offset"]
        return self._data[start : start + header["sh_size"]]

    def file_bytes(self, offset: int, size: int) -> bytes:
        """The file's bytes at ``offset`` (fewer at its end)."""
        return self._data[offset : offset + size]

    def section_addr(self, name: str) -> int | None:
        header = self._sections.get(name)
        return None if header is None else int(header["sh_addr"])

    def code_ranges(self) -> list[tuple[int, int]]:
        """(start, end) addresses of every executable section."""
        return [
            (int(h["sh_addr"]), int(h["sh_addr"] + h["sh_size"]))
            for h in self._section_list
            if h["sh_flags"] & _SHF_EXECINSTR
        ]

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
    def text_sha256(self) -> str:
        return hashlib.sha256(self.text_bytes).hexdigest()

    @cached_property
    def symbols(self) -> SymbolTable:
        symbols: list[Symbol] = []
        for name in (".symtab", ".dynsym"):
            symbols += self._read_symbols(name)
        return SymbolTable(symbols)

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
        """Source lines and inlined frames (DWARF), decoded on first lookup; None without DWARF."""
        return LineTable(self._dwarf) if self.section(".debug_line") else None

    def _dwarf(self) -> Any:
        elf = ELFFile(io.BytesIO(self._data))
        return elf.get_dwarf_info() if elf.has_dwarf_info() else None

    def _read_symbols(self, name: str) -> list[Symbol]:
        header = self._sections.get(name)
        data = self.section(name)
        if header is None or data is None or header["sh_link"] >= len(self._section_list):
            return []
        strtab_header = self._section_list[header["sh_link"]]
        start = strtab_header["sh_offset"]
        strtab = self._data[start : start + strtab_header["sh_size"]]
        executable = {i for i, h in enumerate(self._section_list) if h["sh_flags"] & _SHF_EXECINSTR}
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
        note = self.section(".note.gnu.build-id")
        if note is None or len(note) < 16:
            return None
        namesz, descsz, note_type = struct.unpack_from("<III", note)
        desc = 12 + (namesz + 3) // 4 * 4
        if note_type != 3 or desc + descsz > len(note):  # NT_GNU_BUILD_ID
            return None
        return note[desc : desc + descsz].hex()
