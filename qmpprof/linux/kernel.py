"""A Linux kernel as a run uses it: the image from /boot (a bzImage, an arm64 Image: plain,
compressed or EFI zboot; or a vmlinux ELF with or without symbols and DWARF), its symbols, its ORC
tables and its BTF, loaded and indexed before the guest is touched.

Symbols come, best first, from ``--kallsyms FILE`` (System.map or /proc/kallsyms text), the
image's ``.symtab`` (a debug vmlinux) or the kallsyms tables built into the image itself.
Unwinding is ORC when the image has it (every distribution kernel since 4.14), else the image's
CFI and frame pointers. The unpacked vmlinux, the decoded kallsyms and an index of the rest are
cached (``cache.py``): a load from the cache maps the vmlinux and builds nothing again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qmpprof.elf.image import ElfImage
from qmpprof.elf.symbols import SymbolTable
from qmpprof.errors import ElfError, KernelImageError, SymbolMapError
from qmpprof.linux import cache
from qmpprof.linux.btf import Btf, BtfError, Kind
from qmpprof.linux.kallsyms import read_kallsyms
from qmpprof.linux.platform import BootTask, KernelFilePlatform, OwnTables
from qmpprof.linux.platforms import boot_image, kernel_file
from qmpprof.linux.symbols import KernelSymbols, parse_symbol_map
from qmpprof.linux.taskstates import task_state_array

Picks = tuple[list[int], list[int], Sequence[int]]  # text symbols' starts, ends, name indexes
# Symbols that say an ELF is a Linux kernel (with .symtab or kallsyms).
_LINUX_MARKS = (".orc_unwind_ip", ".BTF", "__ksymtab", "__ksymtab_strings")
# The kinds of BTF types a run looks up by name (structs, unions, typedefs, enums, per-CPU
# data): the index of their names is cached with the BTF's.
_NAMED_KINDS = (Kind.STRUCT, Kind.UNION, Kind.TYPEDEF, Kind.ENUM, Kind.DATASEC)
PER_CPU_SECTION = ".data..percpu"  # the per-CPU area's initial copy, in every kernel image
# Where the initial task's stack starts and ends (vmlinux.lds: __end_init_task before 6.6,
# __end_init_stack after): its size is every task's kernel stack size, THREAD_SIZE.
_INIT_STACK = ("init_stack", ("__end_init_task", "__end_init_stack"))


@dataclass(frozen=True, slots=True, eq=False)
class LinuxKernel:
    """What a run needs of a Linux kernel image. ``symbols`` are kallsyms' (data symbols too,
    at link addresses), ``functions`` name code (the image's ``.symtab`` when it has one, with
    sizes, else kallsyms' text symbols). ``missing`` says, one line each, what the image lacks
    (no ORC, no BTF) so that a run can say it once."""

    image: ElfImage
    symbols: KernelSymbols
    functions: SymbolTable
    tables: OwnTables | None  # its own unwinding tables (x86_64's ORC), as its platform read them
    btf: Btf | None
    span: tuple[int, int]  # link addresses of the kernel's loaded upper-half code
    missing: tuple[str, ...] = ()
    # Where --kallsyms says the kernel was (its _text less the image's): the slide of the boot
    # it was taken from, 0 for a System.map; None without --kallsyms.
    kallsyms_slide: int | None = None

    @classmethod
    def load(cls, path: str | Path, kallsyms: str | Path | None = None) -> LinuxKernel:
        """Read ``path`` (bzImage, arm64 Image or vmlinux) and index it, from the cache where it
        holds this image's indexes. Raises ElfError (KernelImageError, SymbolMapError) with one
        line, never anything else."""
        name = str(path)
        key, data = _key(path, name)
        index = cache.load_index(key)
        image, unpacked = _image(name, path, data, key, index)
        if not is_linux(image):
            raise KernelImageError(name, "not a Linux kernel (no ORC, BTF or ksymtab sections)")
        if index is not None and index.vmlinux_size != image.size:
            index = None  # not the index of this vmlinux: the cached one was replaced
        symbols = None if kallsyms is not None else cache.load_symbols(key)
        new_symbols, given = None, None
        if symbols is None:
            symbols, given = _symbols(image, kallsyms)
            new_symbols = symbols if kallsyms is None else None
        functions, text_picks = _functions(image, symbols, None if kallsyms else index)
        platform = kernel_file(image.arch.name)
        tables: OwnTables | None = None
        notes: list[str] = []
        if platform is not None:
            cached = None if index is None else index.orc
            tables, notes = platform.own_tables(image, cached, functions.starts)
        btf, missing = _btf(image, index)
        missing = notes + missing
        new_index = None  # kept when built here: not with --kallsyms (not the image's own)
        if kallsyms is None and _stale(index, text_picks, tables, btf):
            new_index = _index(image, text_picks, tables, btf)
        if unpacked is not None or new_symbols is not None or new_index is not None:
            cache.store(key, unpacked, new_symbols, new_index)
        span = _span(image)
        return cls(image, symbols, functions, tables, btf, span, tuple(missing), given)

    @property
    def path(self) -> str:
        return self.image.path

    def prepare(self) -> LinuxKernel:
        """Build what the first sample would otherwise build inside its pause."""
        if self.tables is None:
            self.image.prepare()
        return self

    @property
    def platform(self) -> KernelFilePlatform | None:
        """What Linux does its own way on the image's instruction set (None: not one Linux is
        read on here)."""
        return kernel_file(self.image.arch.name)

    @property
    def per_cpu_start(self) -> int | None:
        """Where the image links its per-CPU area: 0 when per-CPU symbols are offsets into a
        zero-based area (x86_64 up to 6.x), else an ordinary address of the image, which
        KASLR moves (7.x, arm64: found by the platform when kallsyms has no ``__per_cpu_start``);
        None when the image has no per-CPU area."""
        section = self.image.section_header(PER_CPU_SECTION)
        if section is not None:
            return section.addr
        found = self.symbols.address_of("__per_cpu_start")
        layout = self._per_cpu_layout() if found is None else None
        return found if layout is None else layout[0]

    @property
    def per_cpu_offsets(self) -> int | None:
        """The link address of ``__per_cpu_offset`` (each CPU's offset into the per-CPU area):
        kallsyms', else where the platform finds it (arm64's boot code); None when not known."""
        found = self.symbols.address_of("__per_cpu_offset")
        layout = self._per_cpu_layout() if found is None else None
        return found if layout is None else layout[1]

    def data_symbol(self, name: str) -> int | None:
        """A data symbol's link address: kallsyms', else (arm64's ``__entry_task``, on kernels
        whose kallsyms name no data) where the platform finds it in the kernel's own code."""
        found = self.symbols.address_of(name)
        platform = self.platform
        if found is None and platform is not None:
            return platform.data_symbol(self.image, self.symbols, name)
        return found

    def _per_cpu_layout(self) -> tuple[int, int] | None:
        """The per-CPU area and ``__per_cpu_offset`` as the platform finds them in the code
        (arm64: a scan of one function's first KiB, not kept)."""
        platform = self.platform
        return None if platform is None else platform.per_cpu_layout(self.image, self.symbols)

    @property
    def module_list(self) -> int | None:
        """The link address of the loaded modules' list head (``modules``): kallsyms', else on
        where the platform finds it (arm64: ``find_module_all``'s code); None when not known."""
        found = self.symbols.address_of("modules")
        platform = self.platform
        if found is None and platform is not None:
            return platform.module_list(self.image, self.symbols)
        return found

    @property
    def thread_size(self) -> int | None:
        """The size of a task's kernel stack, from the initial task's (None: not told)."""
        start = self.symbols.address_of(_INIT_STACK[0])
        ends = (self.symbols.address_of(name) for name in _INIT_STACK[1])
        end = next((found for found in ends if found is not None), None)
        if start is None or end is None or not 0 < end - start <= 1 << 20:
            return None
        size = end - start
        return size if size & (size - 1) == 0 else None

    @property
    def boot_task(self) -> BootTask | None:
        """``init_task`` and ``THREAD_SIZE`` as the platform finds them in the boot code, for
        kallsyms that name neither (arm64: bookworm's 6.1); None elsewhere."""
        platform = self.platform
        if platform is None or self.btf is None:
            return None
        return platform.boot_task(self.image, self.symbols, self.btf)

    def off_cpu_addresses(self) -> tuple[int | None, int | None, int | None]:
        """The link addresses of ``init_task`` and ``task_state_array``, and ``THREAD_SIZE``,
        as --off-cpu reads every task: kallsyms' where they name them, else found in the
        image (the boot code, the array by its content: 0.4 s on 6.1)."""
        init_task = self.symbols.address_of("init_task")
        size = self.thread_size
        if init_task is None or size is None:
            booted = self.boot_task
            if booted is not None:
                init_task = init_task or booted.init_task
                size = size or booted.thread_size
        array = self.symbols.address_of("task_state_array") or task_state_array(self.image)
        return init_task, array, size

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


def looks_like_linux(head: bytes, elf: ElfImage | None) -> bool:
    """Whether a file whose first bytes are ``head`` (and which is ``elf`` when an ELF) is a
    Linux kernel image: a platform's boot image (a bzImage, an arm64 Image: plain, compressed
    or EFI zboot), or an ELF with the sections only Linux kernels have."""
    return boot_image(head) is not None or (elf is not None and is_linux(elf))


def _key(path: str | Path, name: str) -> tuple[str, bytes | None]:
    """The SHA-256 of the image file, and its bytes when they were read for it: the cache
    remembers the key of a file it has seen while the file is unchanged (its device, inode,
    size, modification and change times: what git trusts), so that a cached load need not
    read and hash it."""
    try:
        stat = os.stat(path)
        key = cache.remembered_key(path, stat)
        if key is not None:
            return key, None
        data = Path(path).read_bytes()
    except OSError as err:
        raise ElfError(name, err.strerror or str(err)) from err
    key = hashlib.sha256(data).hexdigest()
    cache.remember_key(path, stat, key)
    return key, data


def _read(path: str | Path, name: str, size: int = -1) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as err:
        raise ElfError(name, err.strerror or str(err)) from err


def _image(
    name: str, path: str | Path, data: bytes | None, key: str, index: cache.KernelIndex | None
) -> tuple[ElfImage, bytes | None]:
    """The vmlinux (the file itself, mapped unless it was read already; the cached one mapped
    when the index vouches for its size; or unpacked from the bzImage, or made of the arm64
    Image, unpacked first when compressed) and, when it was unpacked here, its bytes. ``data``:
    the file's bytes if they were read already."""
    head = data if data is not None else _read(path, name, 0x300)
    platform = boot_image(head)
    if platform is None:
        if data is None:
            return ElfImage.load(name, mapped=True), None
        return ElfImage.from_bytes(name, data), None
    mapped = None if index is None else cache.map_vmlinux(key, index.vmlinux_size)
    if mapped is not None:
        with contextlib.suppress(ElfError):
            return ElfImage.from_bytes(name, mapped), None
    if data is None:
        data = _read(path, name)
    unpacked = platform.elf_of_boot_image(data, name)
    return ElfImage.from_bytes(name, unpacked), unpacked


def _functions(
    image: ElfImage, symbols: KernelSymbols, index: cache.KernelIndex | None
) -> tuple[SymbolTable, Picks | None]:
    """What names code: the image's ``.symtab`` when it has one, else kallsyms' text symbols
    (placed by the index when it has them); and where those are, for the index."""
    if len(image.symbols):
        return image.symbols, None
    names = symbols.names
    picks = index.functions if index is not None else None
    if picks is not None:
        try:
            chosen = list(map(names.__getitem__, picks[2]))
            return SymbolTable.from_sorted(picks[0], picks[1], chosen), picks
        except IndexError:  # not these symbols' picks: made again
            pass
    starts, ends, fresh = symbols.text_picks(None)
    chosen = [names[i] for i in fresh]
    return SymbolTable.from_sorted(starts, ends, chosen), (starts, ends, fresh)


def _btf(image: ElfImage, index: cache.KernelIndex | None) -> tuple[Btf | None, list[str]]:
    """The image's BTF (on the index's type index when it fits) and what a run lacks without."""
    data = image.section(".BTF")
    if data is None:
        return None, ["no BTF (CONFIG_DEBUG_INFO_BTF): no process names"]
    if index is not None and index.btf is not None:
        with contextlib.suppress(BtfError):
            return Btf(data, index.btf), []
    try:
        return Btf(data), []
    except BtfError as err:
        return None, [f"unreadable BTF ({err}): no process names"]


def _stale(
    index: cache.KernelIndex | None,
    text_picks: Picks | None,
    tables: OwnTables | None,
    btf: Btf | None,
) -> bool:
    """Whether something was built here rather than taken from ``index`` (all or a part of it
    missing, or not fitting the image)."""
    if index is None:
        return True
    cached_orc = None if index.orc is None else index.orc.offsets
    return (
        (text_picks is not None and text_picks is not index.functions)
        or (tables is not None and tables.offsets is not cached_orc)
        or (btf is not None and btf.index is not index.btf)
    )


def _index(
    image: ElfImage,
    text_picks: Picks | None,
    tables: OwnTables | None,
    btf: Btf | None,
) -> cache.KernelIndex:
    orc_index = None if tables is None else tables.index()
    btf_index = None if btf is None else btf.with_names(_NAMED_KINDS)
    return cache.KernelIndex(image.size, text_picks, orc_index, btf_index)


def _symbols(image: ElfImage, kallsyms: str | Path | None) -> tuple[KernelSymbols, int | None]:
    """kallsyms from the image, or from ``--kallsyms``: a System.map, or a /proc/kallsyms taken
    from a guest that booted with KASLR, whose addresses are moved back to link addresses by
    where it says ``_text`` (or ``_stext``) is against the image (that shift returned too;
    None without it)."""
    if kallsyms is None:
        return read_kallsyms(image), None
    try:
        text = Path(kallsyms).read_text(errors="replace")
    except OSError as err:
        raise SymbolMapError(str(kallsyms), err.strerror or str(err)) from err
    symbols = parse_symbol_map(text, str(kallsyms))
    start: int | None = symbols.address_of("_text")
    linked: int | None = image.text_addr
    if start is None:  # arm64's /proc/kallsyms leaves out the head (_text): its _stext then
        start, linked = symbols.address_of("_stext"), read_kallsyms(image).address_of("_stext")
    if start is None or linked is None:
        raise SymbolMapError(str(kallsyms), "no _text or _stext symbol: not this kernel's symbols")
    shift = start - linked
    if shift:
        # Only the image moves: per-CPU symbols (absolute offsets) and modules stay.
        addrs = [
            a - shift if module is None and a >= image.arch.shared_from else a
            for a, module in zip(symbols.addrs, symbols.modules, strict=True)
        ]
        symbols = KernelSymbols(addrs, symbols.types, symbols.names, symbols.modules)
    return symbols, shift


def _span(image: ElfImage) -> tuple[int, int]:
    """The upper-half range of the kernel's code and data. A vmlinux also loads its per-CPU
    section at address 0, which is not where anything runs: it is left out."""
    ranges = [(lo, hi) for lo, hi in image.code_ranges() if lo >= image.arch.shared_from]
    if not ranges:
        raise KernelImageError(image.path, "no kernel code in the upper half of the address space")
    return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)
