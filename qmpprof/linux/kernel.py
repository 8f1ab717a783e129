"""A Linux kernel as a run uses it: the image from /boot (a bzImage, or a vmlinux ELF with or
without symbols and DWARF), its symbols, its ORC tables and its BTF, loaded and indexed before
the guest is touched; and the kernel's ``Module`` at the slide the running kernel was found at.

Symbols come, best first, from ``--kallsyms FILE`` (System.map or /proc/kallsyms text), the
image's ``.symtab`` (a debug vmlinux) or the kallsyms tables built into the image itself.
Unwinding is ORC when the image has it (every distribution kernel since 4.14), else the image's
CFI and frame pointers. The unpacked vmlinux and the decoded kallsyms are cached (``cache.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from qmpprof.elf.image import ElfImage
from qmpprof.elf.symbols import SymbolTable
from qmpprof.errors import ElfError, KernelImageError, SymbolMapError
from qmpprof.linux import cache
from qmpprof.linux.btf import Btf, BtfError
from qmpprof.linux.bzimage import is_bzimage, vmlinux_bytes
from qmpprof.linux.kallsyms import read_kallsyms
from qmpprof.linux.orc import OrcStep, OrcTable
from qmpprof.linux.symbols import KernelSymbols, parse_symbol_map
from qmpprof.model import Mapping
from qmpprof.unwind.space import Module

UPPER_HALF = 0xFFFF_8000_0000_0000
# Symbols that say an ELF is a Linux kernel (with .symtab or kallsyms).
_LINUX_MARKS = (".orc_unwind_ip", ".BTF", "__ksymtab", "__ksymtab_strings")


@dataclass(frozen=True, slots=True, eq=False)
class LinuxKernel:
    """What a run needs of a Linux kernel image. ``symbols`` are kallsyms' (data symbols too,
    at link addresses), ``functions`` name code (the image's ``.symtab`` when it has one, with
    sizes, else kallsyms' text symbols). ``missing`` says, one line each, what the image lacks
    (no ORC, no BTF) so that a run can say it once."""

    image: ElfImage
    symbols: KernelSymbols
    functions: SymbolTable
    orc: OrcTable | None
    btf: Btf | None
    span: tuple[int, int]  # link addresses of the kernel's loaded upper-half code
    missing: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: str | Path, kallsyms: str | Path | None = None) -> LinuxKernel:
        """Read ``path`` (bzImage or vmlinux) and index it. Raises ElfError (KernelImageError,
        SymbolMapError) with one line, never anything else."""
        name = str(path)
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise ElfError(name, err.strerror or str(err)) from err
        key = hashlib.sha256(data).hexdigest()
        unpacked = None
        if is_bzimage(data):
            data = cache.load_vmlinux(key) or vmlinux_bytes(data, name)
            unpacked = data
        image = ElfImage.from_bytes(name, data)
        if not is_linux(image):
            raise KernelImageError(name, "not a Linux kernel (no ORC, BTF or ksymtab sections)")
        symbols = None if kallsyms is not None else cache.load_symbols(key)
        if symbols is None:
            symbols = _symbols(image, kallsyms)
            if kallsyms is None:
                cache.store(key, unpacked, symbols)
        functions = image.symbols if len(image.symbols) else symbols.symbol_table()
        missing = []
        orc = OrcTable.from_image(image)
        if orc is None:
            missing.append("no ORC tables (CONFIG_UNWINDER_ORC): kernel stacks by frame pointers")
        try:
            btf = Btf.from_image(image)
            if btf is None:
                missing.append("no BTF (CONFIG_DEBUG_INFO_BTF): no process names")
        except BtfError as err:
            btf = None
            missing.append(f"unreadable BTF ({err}): no process names")
        return cls(image, symbols, functions, orc, btf, _span(image), tuple(missing))

    @property
    def path(self) -> str:
        return self.image.path

    def prepare(self) -> LinuxKernel:
        """Build what the first sample would otherwise build inside its pause."""
        if self.orc is None:
            self.image.prepare()
        return self

    def module(self, slide: int = 0, *, lines: bool = False) -> Module:
        """The kernel image as loaded at ``slide`` (runtime - link address: the KASLR slide)."""
        low, high = self.span
        image = self.image
        mapping = Mapping(
            "vmlinux", low + slide, high + slide, True, slide, image.path, image.build_id, 0
        )
        line_table = image.lines if lines else None
        if self.orc is not None:
            step = OrcStep(self.orc, slide, self.functions, self.thunks)
            return Module(mapping, (step,), self.functions, line_table)
        return Module.build(
            mapping,
            cfi=image.cfi,
            code=image.text_bytes,
            code_addr=image.text_addr,
            symbols=self.functions,
            lines=line_table,
        )

    @property
    def thunks(self) -> tuple[int, int] | None:
        """Link addresses of the retpoline and return thunks, where kallsyms marks them (before
        6.4: their ORC entries read as the end of the stack)."""
        start = self.symbols.address_of("__indirect_thunk_start")
        end = self.symbols.address_of("__indirect_thunk_end")
        return None if start is None or end is None else (start, end)

    def address(self, name: str, slide: int = 0) -> int | None:
        """A kernel symbol's runtime address (data symbols too, where kallsyms has them)."""
        addr = self.symbols.address_of(name)
        return None if addr is None else addr + slide


def is_linux(image: ElfImage) -> bool:
    """An x86_64 ELF is a Linux kernel when it has the sections only Linux kernels have."""
    return any(image.section_addr(mark) is not None for mark in _LINUX_MARKS)


def looks_like_linux(path: str | Path) -> bool:
    """A quick look at a file: a bzImage, or an ELF a Linux kernel would be (for ``--os auto``).
    Unreadable files are not Linux here: loading them says why."""
    try:
        with open(path, "rb") as f:
            head = f.read(0x300)
    except OSError:
        return False
    if is_bzimage(head):
        return True
    if not head.startswith(b"\x7fELF"):
        return False
    try:
        return is_linux(ElfImage.load(path))
    except ElfError:
        return False


def _symbols(image: ElfImage, kallsyms: str | Path | None) -> KernelSymbols:
    """kallsyms from the image, or from ``--kallsyms``: a System.map, or a /proc/kallsyms taken
    from a guest that booted with KASLR, whose addresses are moved back to link addresses by
    where it says ``_text`` is against the image."""
    if kallsyms is None:
        return read_kallsyms(image)
    try:
        text = Path(kallsyms).read_text(errors="replace")
    except OSError as err:
        raise SymbolMapError(str(kallsyms), err.strerror or str(err)) from err
    symbols = parse_symbol_map(text, str(kallsyms))
    start = symbols.address_of("_text")
    if start is None:
        raise SymbolMapError(str(kallsyms), "no _text symbol: not this kernel's symbols")
    shift = start - image.text_addr
    if shift:
        # Only the image moves: per-CPU symbols (absolute offsets) and modules stay.
        addrs = [
            a - shift if module is None and a >= UPPER_HALF else a
            for a, module in zip(symbols.addrs, symbols.modules, strict=True)
        ]
        symbols = KernelSymbols(addrs, symbols.types, symbols.names, symbols.modules)
    return symbols


def _span(image: ElfImage) -> tuple[int, int]:
    """The upper-half range of the kernel's code and data. A vmlinux also loads its per-CPU
    section at address 0, which is not where anything runs: it is left out."""
    ranges = [(lo, hi) for lo, hi in image.code_ranges() if lo >= UPPER_HALF]
    if not ranges:
        raise KernelImageError(image.path, "no kernel code in the upper half of the address space")
    return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)
