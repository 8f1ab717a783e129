"""riscv64 Linux's kernel file (``platform.KernelFilePlatform``): the vmlinux ELF (the -dbg
package's), whose kallsyms (CONFIG_KALLSYMS_ALL: Debian's) name every data symbol a run reads,
so that nothing is looked for in its code. The boot ``Image`` is told by its header
(Documentation/arch/riscv/boot-image-header.rst: ``text_offset`` and ``image_size`` as u64 at
8 and 16, the magic ``RSC\\x05`` at 0x38) and not read yet: a run names it as such."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError
from qmpprof.linux.btf import Btf
from qmpprof.linux.cache import OrcIndex
from qmpprof.linux.platform import BootTask, OwnTables
from qmpprof.linux.symbols import KernelSymbols

MAGIC = b"RSC\x05"  # the Image header's magic2, at MAGIC_AT
MAGIC_AT = 0x38


def is_riscv64_image(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a riscv64 Linux ``Image`` (its EFI form too:
    the PE header follows the Image header, which keeps its magic)."""
    return head[MAGIC_AT : MAGIC_AT + len(MAGIC)] == MAGIC


@dataclass(frozen=True, slots=True)
class Riscv64KernelFile:
    name: str = "riscv64"

    def is_boot_image(self, head: bytes) -> bool:
        return is_riscv64_image(head)

    def elf_of_boot_image(self, data: bytes, path: str) -> bytes:
        raise KernelImageError(
            path, "a riscv64 Image is not read yet: give the -dbg package's vmlinux"
        )

    def per_cpu_layout(self, image: ElfImage, symbols: KernelSymbols) -> tuple[int, int] | None:
        return None

    def data_symbol(self, image: ElfImage, symbols: KernelSymbols, name: str) -> int | None:
        return None

    def module_list(self, image: ElfImage, symbols: KernelSymbols) -> int | None:
        return None

    def boot_task(self, image: ElfImage, symbols: KernelSymbols, btf: Btf) -> BootTask | None:
        return None

    def own_tables(
        self, image: ElfImage, cached: OrcIndex | None, starts: Sequence[int]
    ) -> tuple[OwnTables | None, list[str]]:
        return None, []  # its kernel stacks are walked by CFI and frame records


RISCV64_FILE = Riscv64KernelFile()
