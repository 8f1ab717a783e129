"""Kernel memory through the kernel's own page tables (linux/running/kernelmemory.py): an address
taken below the span its top-level table translates. riscv64's kernel half is in the same table
as user space, above its end: an Sv39 table built by hand (riscv's entries: the PPN at bits
10..53, R/W/X marking a leaf), a vmalloc'd page at an address whose bit 38 picks its top-level
entry."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from qmpprof.linux.riscv64.running import RISCV64_ENTRIES
from qmpprof.linux.running.kernelmemory import _through_tables
from qmpprof.linux.running.pagetables import PageTables

DIRECT = 0xFFFF_FFD8_0000_0000  # Sv39's linear map: physical memory from here
V, R, W = 1, 2, 4
ROOT, MIDDLE, LAST, DATA = 0x8100_0000, 0x8100_1000, 0x8100_2000, 0x8200_0000
STACK = 0xFFFF_FFC6_8000_1000  # a vmalloc'd page: bits 38..30 give top-level index 0x11A


def pte(physical: int, flags: int) -> int:
    return (physical >> 12) << 10 | flags


class Physical:
    """Physical pages by hand, read through the linear map."""

    def __init__(self) -> None:
        self.pages: dict[int, bytearray] = {}

    def put(self, phys: int, word: int) -> None:
        page = self.pages.setdefault(phys & ~0xFFF, bytearray(4096))
        page[phys & 0xFFF : (phys & 0xFFF) + 8] = struct.pack("<Q", word)

    async def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for addr, size in ranges:
            page = self.pages.get((addr - DIRECT) & ~0xFFF)
            at = addr & 0xFFF
            out.append(None if page is None else bytes(page[at : at + size]))
        return out


async def test_a_kernel_address_is_walked_below_the_tables_span() -> None:
    memory = Physical()
    sv39 = (1 << 39) - 1
    memory.put(ROOT + 8 * ((STACK & sv39) >> 30), pte(MIDDLE, V))
    memory.put(MIDDLE + 8 * ((STACK >> 21) & 511), pte(LAST, V))
    memory.put(LAST + 8 * ((STACK >> 12) & 511), pte(DATA, V | R | W))
    memory.put(DATA + 0x10, 0x1122_3344_5566_7788)
    tables = PageTables(memory.read, DIRECT, 3, RISCV64_ENTRIES, 1 << 38, span=1 << 39)
    found = await _through_tables(tables, DIRECT + ROOT, STACK + 0x10, 8)
    assert found == struct.pack("<Q", 0x1122_3344_5566_7788)
    # Taken below user space's end instead (bit 38 lost): top-level entry 0x1A, not mapped.
    below_end = PageTables(memory.read, DIRECT, 3, RISCV64_ENTRIES, 1 << 38)
    assert await _through_tables(below_end, DIRECT + ROOT, STACK + 0x10, 8) is None
