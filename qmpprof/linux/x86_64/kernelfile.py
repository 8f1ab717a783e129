"""x86_64 Linux's kernel file (``platform.KernelFilePlatform``): a bzImage, whose kallsyms name
every data symbol a run reads, so that nothing is looked for in its code."""

from __future__ import annotations

from dataclasses import dataclass

from qmpprof.elf.image import ElfImage
from qmpprof.linux.btf import Btf
from qmpprof.linux.bzimage import is_bzimage, vmlinux_bytes
from qmpprof.linux.platform import BootTask
from qmpprof.linux.symbols import KernelSymbols


@dataclass(frozen=True, slots=True)
class X86_64KernelFile:
    name: str = "x86_64"

    def is_boot_image(self, head: bytes) -> bool:
        return is_bzimage(head)

    def elf_of_boot_image(self, data: bytes, path: str) -> bytes:
        return vmlinux_bytes(data, path)

    def per_cpu_layout(self, image: ElfImage, symbols: KernelSymbols) -> tuple[int, int] | None:
        return None

    def data_symbol(self, image: ElfImage, symbols: KernelSymbols, name: str) -> int | None:
        return None

    def module_list(self, image: ElfImage, symbols: KernelSymbols) -> int | None:
        return None

    def boot_task(self, image: ElfImage, symbols: KernelSymbols, btf: Btf) -> BootTask | None:
        return None


X86_64_FILE = X86_64KernelFile()
