"""The bundled guest's built ELF files read for the tests: the workload shape expected.json
promises (x86_64, and the two i386 builds), section and symbol tables by name."""

from __future__ import annotations

from pathlib import Path

from elftools.elf.elffile import ELFFile
from guestvm import expected, section

EXPECTED = expected()
KERNEL_BOUNDARY = int(EXPECTED["kernel_boundary"], 16)
# The workload and the layout are the same in both i386 builds; paging differs (expected.json).
I386_VARIANTS = ("i386", "i386-pae")
I386_EXPECTED = expected("i386")
I386_BOUNDARY = int(I386_EXPECTED["kernel_boundary"], 16)


def elf_sections(path: Path) -> dict[str, tuple[int, int]]:
    """Section name -> (address, size)."""
    with path.open("rb") as f:
        return {s.name: (s["sh_addr"], s["sh_size"]) for s in ELFFile(f).iter_sections()}


def elf_symbols(path: Path) -> dict[str, int]:
    with path.open("rb") as f:
        symtab = section(ELFFile(f), ".symtab")
        return {s.name: s["st_value"] for s in symtab.iter_symbols() if s.name}


def sized_symbols(path: Path) -> dict[str, tuple[int, int]]:
    """Symbol name -> (address, size)."""
    with path.open("rb") as f:
        symtab = section(ELFFile(f), ".symtab")
        return {s.name: (s["st_value"], s["st_size"]) for s in symtab.iter_symbols() if s.name}
