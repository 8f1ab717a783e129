"""arm64 Linux's kernel file (``platform.KernelFilePlatform``): an Image (plain, compressed or
EFI zboot), and its code read for what kallsyms without data symbols (bookworm's 6.1) do not
name: the per-CPU area, ``__entry_task``, the module list, the initial task."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.elf.image import ElfImage
from qmpprof.linux.aarch64.bootcode import boot_task
from qmpprof.linux.aarch64.kernelimage import elf_of_image, is_arm64_kernel
from qmpprof.linux.aarch64.modulelist import module_list
from qmpprof.linux.aarch64.percpu import entry_task_link, per_cpu_layout
from qmpprof.linux.btf import Btf
from qmpprof.linux.cache import OrcIndex
from qmpprof.linux.platform import BootTask, OwnTables
from qmpprof.linux.symbols import KernelSymbols


@dataclass(frozen=True, slots=True)
class Aarch64KernelFile:
    name: str = "aarch64"

    def is_boot_image(self, head: bytes) -> bool:
        return is_arm64_kernel(head)

    def elf_of_boot_image(self, data: bytes, path: str) -> bytes:
        return elf_of_image(data, path)

    def per_cpu_layout(self, image: ElfImage, symbols: KernelSymbols) -> tuple[int, int] | None:
        return per_cpu_layout(image, symbols)

    def data_symbol(self, image: ElfImage, symbols: KernelSymbols, name: str) -> int | None:
        return entry_task_link(image, symbols) if name == "__entry_task" else None

    def module_list(self, image: ElfImage, symbols: KernelSymbols) -> int | None:
        return module_list(image, symbols)

    def boot_task(self, image: ElfImage, symbols: KernelSymbols, btf: Btf) -> BootTask | None:
        return boot_task(image, symbols, btf)

    def own_tables(
        self, image: ElfImage, cached: OrcIndex | None, starts: Sequence[int]
    ) -> tuple[OwnTables | None, list[str]]:
        return None, []  # its kernel stacks are walked by CFI and frame records


AARCH64_FILE = Aarch64KernelFile()
