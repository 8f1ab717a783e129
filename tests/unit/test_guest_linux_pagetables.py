"""Page-table walks of a Linux process through the kernel's direct map
(linux/running/pagetables.py), over fake physical memory: 4 and 5 levels, 1 GiB and 2 MiB
pages, holes, reads that cross a page, the variables that say the layout."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from qmpprof.linux.running.pagetables import (
    AARCH64_ENTRIES,
    DIRECT_MAP_4,
    DIRECT_MAP_5,
    PageTables,
    page_tables,
)

BASE = 0xFFFF_9A00_0000_0000  # a KASLR'd page_offset_base
PRESENT, WRITE, USER, HUGE, NX = 1, 2, 4, 1 << 7, 1 << 63


class Physical:
    """Physical memory seen through a direct map at ``base``: what a kernel-memory read sees."""

    def __init__(self, base: int = BASE) -> None:
        self.base = base
        self.bytes: dict[int, bytearray] = {}
        self.reads = 0  # ranges read
        self.requests = 0  # calls of read

    def put(self, phys: int, data: bytes) -> None:
        for i, byte in enumerate(data):
            page = (phys + i) & ~0xFFF
            self.bytes.setdefault(page, bytearray(4096))[phys + i - page] = byte

    def entry(self, table: int, index: int, value: int) -> None:
        self.put(table + 8 * index, struct.pack("<Q", value))

    async def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        self.requests += 1
        for addr, size in ranges:
            self.reads += 1
            phys = addr - self.base
            page = self.bytes.get(phys & ~0xFFF)
            inside = page is not None and (phys & 0xFFF) + size <= 4096
            out.append(bytes(page[phys & 0xFFF : (phys & 0xFFF) + size]) if inside else None)
        return out


def indexes(va: int, levels: int) -> list[int]:
    return [(va >> (12 + 9 * (level - 1))) & 511 for level in range(levels, 0, -1)]


def four_levels(memory: Physical, va: int, page: int) -> tuple[int, int, int, int]:
    """Tables at fixed places mapping ``va`` to physical ``page``: their addresses, top first."""
    tables = (0x10_0000, 0x11_0000, 0x12_0000, 0x13_0000)
    targets = (*tables[1:], page)
    for table, index, target in zip(tables, indexes(va, 4), targets, strict=True):
        memory.entry(table, index, target | PRESENT)
    return tables


async def test_four_levels_huge_pages_and_holes() -> None:
    memory = Physical()
    pgd, pud, pmd, pte = 0x10_0000, 0x11_0000, 0x12_0000, 0x13_0000
    code = 0x5555_5555_4000  # a PIE's text
    i4, i3, i2, i1 = indexes(code, 4)
    memory.entry(pgd, i4, pud | PRESENT | WRITE | USER)
    memory.entry(pud, i3, pmd | PRESENT | USER)
    memory.entry(pmd, i2, pte | PRESENT | USER)
    memory.entry(pte, i1, 0x7_7000 | PRESENT | USER | NX)
    memory.put(0x7_7000 + 0x123, b"\x55\x48\x89\xe5")  # push rbp; mov rbp, rsp
    # A 2 MiB page (PS in the PMD entry) and a 1 GiB page (PS in the PUD entry).
    lib = 0x7F00_0020_0000
    j4, j3, j2, _ = indexes(lib, 4)
    memory.entry(pgd, j4, 0x14_0000 | PRESENT | USER)
    memory.entry(0x14_0000, j3, 0x15_0000 | PRESENT | USER)
    memory.entry(0x15_0000, j2, 0x4000_0000 | PRESENT | USER | HUGE | (1 << 12))  # PAT bit
    big = 0x7E00_4000_0000
    k4, k3, *_ = indexes(big, 4)
    memory.entry(pgd, k4, 0x16_0000 | PRESENT | USER)
    memory.entry(0x16_0000, k3, 0x8000_0000 | PRESENT | USER | HUGE)
    memory.entry(pte, i1 + 1, 0x7_8000)  # swapped out: not present
    tables = PageTables(memory.read, BASE)
    assert await tables.physical(BASE + pgd, code + 0x123) == 0x7_7123
    read = tables.reader(BASE + pgd)
    assert await read([(code + 0x123, 4)]) == [b"\x55\x48\x89\xe5"]
    assert await tables.physical(BASE + pgd, lib + 0x1_2345) == 0x4001_2345
    assert await tables.physical(BASE + pgd, big + 0x1234_5678) == 0x8000_0000 + 0x1234_5678
    # Not present at any level, or a read crossing a page: nothing.
    assert await tables.physical(BASE + pgd, 0x4000_0000) is None
    assert await tables.physical(BASE + pgd, code + 0x1000) is None
    assert await read([(code + 0xFFE, 4)]) == [None]
    # Table pages are read once each.
    before = memory.reads
    await tables.physical(BASE + pgd, code + 0x10)
    assert memory.reads == before


async def test_five_levels_and_the_layout_from_the_kernel_s_variables() -> None:
    memory = Physical(DIRECT_MAP_5)
    l5, pob = 0xFFFF_FFFF_825D_85B8, 0xFFFF_FFFF_825D_85A8
    variables = {l5: (1).to_bytes(4, "little")}

    async def kernel(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        if all(a in variables for a, _ in ranges):
            return [variables[a][:n] for a, n in ranges]
        return await memory.read(ranges)

    tables = await page_tables(kernel, None, l5)  # no page_offset_base: the fixed base
    assert (tables.levels, tables.direct_map) == (5, DIRECT_MAP_5)
    va = 0x5555_5555_4000
    chain = [0x20_0000, 0x21_0000, 0x22_0000, 0x23_0000, 0x24_0000]
    for table, index, following in zip(chain, indexes(va, 5), [*chain[1:], 0x9000], strict=True):
        memory.entry(table, index, following | PRESENT | USER)
    assert await tables.physical(DIRECT_MAP_5 + chain[0], va + 8) == 0x9008
    variables[l5] = bytes(4)
    variables[pob] = BASE.to_bytes(8, "little")
    four = await page_tables(kernel, pob, l5)
    assert (four.levels, four.direct_map) == (4, BASE)
    assert (await page_tables(kernel, None, None)).direct_map == DIRECT_MAP_4


async def test_arm64_five_levels_from_a_top_table_inside_a_page() -> None:
    """52-bit virtual addresses (LPA2, 6.12 under -cpu max): a 16-entry top level allocated
    from a cache (mm->pgd 0x...f80 seen), tables by bit 1, a 2 MiB block by bit 1 clear, and the
    attribute bits above 47 (BTI's guarded page, bit 50) not taken for the address."""
    memory = Physical()
    valid, table, page, gp = 1, 2, 3, 1 << 50
    top = 0x10_0F80  # not page-aligned: the 128-byte level -1 table
    l0, l1, l2, l3 = 0x11_0000, 0x12_0000, 0x13_0000, 0x14_0000
    stack = 0xFFFF_DDA1_8010  # a 48-bit user address: entry 0 of the top level
    i5, i4, i3, i2, i1 = indexes(stack, 5)
    assert i5 == 0
    memory.entry(top, i5, l0 | valid | table)
    memory.entry(l0, i4, l1 | valid | table)
    memory.entry(l1, i3, l2 | valid | table)
    memory.entry(l2, i2, l3 | valid | table)
    memory.entry(l3, i1, 0x7_7000 | valid | page | gp)
    memory.entry(top - 8, 0, 0xDEAD_0000 | valid | table)  # the table before it in that page
    code = 0xAAAA_E260_0000  # a 2 MiB boundary, under the same top entry
    j5, j4, j3, j2, _ = indexes(code, 5)
    assert j5 == i5
    memory.entry(l0, j4, 0x15_0000 | valid | table)
    memory.entry(0x15_0000, j3, 0x16_0000 | valid | table)
    memory.entry(0x16_0000, j2, 0x4020_0000 | valid | gp)  # a block: bit 1 clear
    tables = PageTables(memory.read, BASE, 5, AARCH64_ENTRIES, 1 << 52)
    assert await tables.physical(BASE + top, stack) == 0x7_7010
    assert await tables.physical(BASE + top, code + 0x1_2345) == 0x4021_2345
    assert tables.user_end == 1 << 52


async def test_a_user_read_is_one_request_its_kept_tables_guessed_and_checked_in_it() -> None:
    """Through ``reader`` a kernel-mode sample's user pages cost one request once the walkers'
    table pages are kept: every entry they gave is read again in the request that reads the
    data, and a changed one (a page moved by copy-on-write, a table freed and reused, a region
    mapped or unmapped since) has the walk made again from the fresh entry and the moved page
    read again, never the stale one returned. ``physical`` alone never guesses."""
    memory = Physical()
    stack = 0x7FFF_F000_0000
    pgd, _, pmd, pte = four_levels(memory, stack, 0x7_7000)
    i2, i1 = indexes(stack, 4)[2:]
    memory.entry(pte, i1 + 1, 0x7_9000 | PRESENT)
    memory.put(0x7_7000, b"old stack")
    memory.put(0x7_9000, b"its caller")
    memory.put(0x8_8000, b"new stack")
    kept: dict[int, bytes | None] = {}

    async def read(ranges: list[tuple[int, int]]) -> tuple[list[bytes | None], int]:
        before = memory.requests
        found = await PageTables(memory.read, BASE, kept=kept).reader(BASE + pgd)(ranges)
        return found, memory.requests - before

    wanted = [(stack, 9), (stack + 0x1000, 10), (stack + 0x2000, 8), (stack + 0xFFC, 8)]
    assert await read(wanted) == ([b"old stack", b"its caller", None, None], 5)  # 4 levels
    assert len(kept) == 4
    assert await read(wanted[:2]) == ([b"old stack", b"its caller"], 1)  # checked with the data
    memory.entry(pte, i1, 0x8_8000 | PRESENT)  # moved: the page it says now read again
    assert await read(wanted[:2]) == ([b"new stack", b"its caller"], 2)
    assert await read(wanted[:2]) == ([b"new stack", b"its caller"], 1)
    memory.entry(pte, i1 + 2, 0x7_7000 | PRESENT)  # mapped since: absent in the guess
    assert await read(wanted[2:3]) == ([b"old stack"[:8]], 2)
    memory.entry(pte, i1 + 1, 0)  # unmapped since: present in the guess
    assert await read(wanted[:2]) == ([b"new stack", None], 1)
    # A table freed and its region's tables made anew elsewhere: the walk follows the new one
    # (read, then the page it gives).
    memory.entry(pmd, i2, 0x14_0000 | PRESENT)
    memory.entry(0x14_0000, i1, 0x7_9000 | PRESENT)
    assert await read(wanted[:1]) == ([b"its caller"[:9]], 3)
    walker = PageTables(memory.read, BASE, kept=kept)
    before = memory.requests
    assert await walker.physical(BASE + pgd, stack) == 0x7_9000
    assert memory.requests == before + 4  # not through the kept pages


async def test_an_entry_not_present_ends_the_walk_read_once_a_walker() -> None:
    memory = Physical()
    va = 0x5555_5555_4000
    pgd = four_levels(memory, va, 0x7_7000)[0]
    walker = PageTables(memory.read, BASE)
    other = 0x7F00_0000_0000
    assert await walker.physical(BASE + pgd, va) == 0x7_7000
    before = memory.reads
    assert await walker.physical(BASE + pgd, other) is None
    assert await walker.physical(BASE + pgd, other + 0x1000) is None
    assert memory.reads == before  # the top level's page read once, its entry absent
