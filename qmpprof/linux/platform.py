"""What Linux does its own way on each instruction set, as the kernel file shows it: one
``KernelFilePlatform`` per instruction set (the shape drgn gives its platforms: the knowledge of
one architecture behind one interface, chosen in one registry, ``platforms``).

What the running guest shows (its slide, page tables, switch frames, entry code) is the other
half, ``qmpprof.linux.running.platform``: this half stays a pure reader of the file, as the rest
of this package's top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from qmpprof.elf.image import ElfImage
from qmpprof.linux.btf import Btf
from qmpprof.linux.symbols import KernelSymbols


@dataclass(frozen=True, slots=True)
class BootTask:
    """``init_task``'s link address and ``THREAD_SIZE``."""

    init_task: int
    thread_size: int


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
