"""What Linux does its own way on each instruction set, as the kernel file shows it: one
``KernelFilePlatform`` per instruction set (the shape drgn gives its platforms: the knowledge of
one architecture behind one interface, chosen in one registry, ``platforms``).

What the running guest shows (its slide, page tables, switch frames, entry code) is the other
half, ``qmpprof.linux.running.platform``: this half stays a pure reader of the file, as the rest
of this package's top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from qmpprof.elf.image import ElfImage
from qmpprof.linux.btf import Btf
from qmpprof.linux.cache import OrcIndex
from qmpprof.linux.symbols import KernelSymbols


@dataclass(frozen=True, slots=True)
class BootTask:
    """``init_task``'s link address and ``THREAD_SIZE``."""

    init_task: int
    thread_size: int


class OwnTables(Protocol):
    """Unwinding tables a kernel image carries of its own (x86_64's ORC), as its platform
    built them; the running platform hands them to the walk (``LinuxPlatform.kernel_steps``)."""

    @property
    def offsets(self) -> Sequence[int]:
        """The tables' index (whether it is the cached one: ``offsets is`` the cache's)."""
        ...

    def index(self) -> OrcIndex:
        """What the cache keeps of them (all but what the image holds as it is)."""
        ...


class KernelFilePlatform(Protocol):
    """One instruction set's Linux kernel file: its boot image and what its code says where its
    kallsyms name no data."""

    @property
    def name(self) -> str:
        """The instruction set's name (``InstructionSet.name``)."""
        ...

    def is_boot_image(self, head: bytes) -> bool:
        """Whether a file starting with ``head`` is this instruction set's boot image (not an
        ELF: what a bootloader loads)."""
        ...

    def elf_of_boot_image(self, data: bytes, path: str) -> bytes:
        """The vmlinux ELF a boot image holds or is; KernelImageError when it holds none."""
        ...

    def per_cpu_layout(self, image: ElfImage, symbols: KernelSymbols) -> tuple[int, int] | None:
        """The per-CPU area's link address and ``__per_cpu_offset``'s, read from the code where
        kallsyms name neither; None when not known."""
        ...

    def data_symbol(self, image: ElfImage, symbols: KernelSymbols, name: str) -> int | None:
        """A data symbol kallsyms do not name, where the kernel's code puts it; None."""
        ...

    def module_list(self, image: ElfImage, symbols: KernelSymbols) -> int | None:
        """The modules' list head, where the code reads it and kallsyms do not name it."""
        ...

    def boot_task(self, image: ElfImage, symbols: KernelSymbols, btf: Btf) -> BootTask | None:
        """``init_task`` and ``THREAD_SIZE`` as the boot code has them; None."""
        ...

    def own_tables(
        self, image: ElfImage, cached: OrcIndex | None, starts: Sequence[int]
    ) -> tuple[OwnTables | None, list[str]]:
        """The image's own unwinding tables (built on ``cached``, the cache's, when it fits;
        ``starts``: the functions' starts), and a line for each thing a run lacks or should know
        of them; None where the image has none (or the instruction set no such tables).
        KernelImageError when they are unreadable."""
        ...
