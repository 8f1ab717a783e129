"""x86_64 Linux's kernel file (``platform.KernelFilePlatform``): a bzImage, whose kallsyms name
every data symbol a run reads, so that nothing is looked for in its code; its own unwinding
tables are ORC (``orctables``), numbered as the image's ``.orc_header`` says."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError
from qmpprof.linux.btf import Btf
from qmpprof.linux.bzimage import is_bzimage, vmlinux_bytes
from qmpprof.linux.cache import OrcIndex
from qmpprof.linux.platform import BootTask, OwnTables
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.linux.x86_64.orctables import OrcLayout, OrcTable, numbering

NO_ORC = "no ORC tables (CONFIG_UNWINDER_ORC): kernel stacks by frame pointers"


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

    def own_tables(
        self, image: ElfImage, cached: OrcIndex | None, starts: Sequence[int]
    ) -> tuple[OwnTables | None, list[str]]:
        orc = _orc(image, cached)
        if orc is None:
            return None, [NO_ORC]
        orc.regs, odd = numbering(image.section(".orc_header"), orc, starts)
        return orc, [odd] if odd else []


def _orc(image: ElfImage, cached: OrcIndex | None) -> OrcTable | None:
    """The image's ORC table, built on the cache's offsets when they fit its sections."""
    entries = image.section(".orc_unwind")
    header = image.section_header(".orc_unwind_ip")
    if cached is not None and entries is not None and header is not None:
        fits = header.addr == cached.base and header.size == 4 * len(cached.offsets)
        with contextlib.suppress(ValueError):
            if fits:
                return OrcTable(
                    cached.base, cached.offsets, entries, OrcLayout(cached.layout), cached.end
                )
    try:
        return OrcTable.from_image(image)
    except ValueError as err:  # .orc_unwind not one entry per ip, a table of no sense
        raise KernelImageError(image.path, f"unreadable ORC tables: {err}") from err


X86_64_FILE = X86_64KernelFile()
