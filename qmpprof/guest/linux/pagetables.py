"""A Linux process's memory read without its page tables loaded: its virtual addresses
translated through its own tables (``mm_struct.pgd``), walked by reading kernel memory.

The kernel maps all physical memory at ``page_offset_base`` (the direct map, randomized with
KASLR's CONFIG_RANDOMIZE_MEMORY; without that variable, the fixed base of the paging mode), and
every page-table page is reachable there: so a reader of kernel memory that needs no stop (QMP
memsave) can read a process's code while the guest runs, before the first sample, when the
vCPUs run other processes. Four levels, or five when ``__pgtable_l5_enabled`` says so (LA57);
1 GiB and 2 MiB pages end the walk early.

arm64's tables (4 KiB granule) are walked the same way through the kernel's linear map
(``linearmap``), with their own entries (``AARCH64_ENTRIES``): a block ends the walk where the
entry's bit 1 is clear, and the output address is bits 12..47 (bits 50 and up are attributes:
BTI's guarded page, the contiguous hint). 52-bit physical addresses (LPA2) are not read. With
52-bit virtual addresses (6.12's, under LPA2) the top level has 16 entries, a 128-byte table
that need not start a page (``mm->pgd`` 0x...3c33f80 seen).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.memory import Reader

DIRECT_MAP_4 = 0xFFFF_8880_0000_0000  # the direct map's base without KASLR, 4-level paging
DIRECT_MAP_5 = 0xFF11_0000_0000_0000  # and with 5-level paging
_PRESENT = 1
_ADDRESS = 0x000F_FFFF_FFFF_F000  # bits 12..51 of an entry: a physical address
_PAGE = 4096


@dataclass(frozen=True, slots=True)
class EntryFormat:
    """What a page-table entry says: its output address bits, and the bit that in a level-2
    or level-3 entry tells a block (a page of 1 GiB or 2 MiB) from a table, when ``block`` is
    its value there."""

    address: int
    block_bit: int
    block: bool


X86_64_ENTRIES = EntryFormat(_ADDRESS, 1 << 7, True)  # PS set: the entry maps the page itself
AARCH64_ENTRIES = EntryFormat(0x0000_FFFF_FFFF_F000, 1 << 1, False)  # bit 1 clear: a block


class PageTables:
    """How to walk any process's page tables through ``read`` (kernel memory). Table pages
    are read whole, once each (a read costs about the same for 8 bytes or 4 KiB, and the
    processes' code and libraries share the upper levels)."""

    def __init__(
        self,
        read: Reader,
        direct_map: int,
        levels: int = 4,
        entries: EntryFormat = X86_64_ENTRIES,
        end: int | None = None,
        upper: dict[int, bytes | None] | None = None,
        last: dict[int, bytes | None] | None = None,
    ) -> None:
        """``end``: where user space ends (None: half of what the levels translate, as on
        x86_64: 2^47 with four levels, 2^56 with five). ``upper``: table pages above the
        last level, kept by the caller across walkers (they change only when a region's
        tables are allocated or freed; an entry not present there is read again once).
        ``last``: last-level table pages kept the same way, but only as guesses: ``reader``
        reads each one it used again in the request that reads the data, and reads again what a
        changed entry moved (so a user page costs one request, not two)."""
        self.read = read
        self.direct_map = direct_map
        self.levels = levels
        self.entries = entries
        self.user_end = user_end(levels) if end is None else end
        self._tables: dict[int, bytes | None] = {}  # a table's kernel address -> its page
        self._upper = upper
        self._last = last
        self._guessed: set[int] = set()  # last-level pages taken from ``last`` unchecked

    def over(self, read: Reader) -> PageTables:
        """The same tables walked through ``read`` (a pause's reads, say), nothing kept."""
        return PageTables(read, self.direct_map, self.levels, self.entries, self.user_end)

    def forget(self) -> None:
        """Drop the table pages read so far (page tables change as processes run)."""
        self._tables.clear()

    async def _entry(
        self, table: int, index: int, level: int = 1, guess: bool = False
    ) -> int | None:
        at = table + 8 * index
        base = at & ~(_PAGE - 1)
        kept = self._tables if level == 1 or self._upper is None else self._upper
        if guess and level == 1 and base not in kept and self._last and base in self._last:
            self._guessed.add(base)
            kept = self._last
        if base not in kept:
            (kept[base],) = await self.read([(base, _PAGE)])
            if level == 1 and self._last is not None:
                self._last[base] = kept[base]
        page = kept[base]
        offset = at - base
        entry = None if page is None else int.from_bytes(page[offset : offset + 8], "little")
        if kept is self._upper and not (entry or 0) & _PRESENT and base not in self._tables:
            self._tables[base] = kept[base] = (await self.read([(base, _PAGE)]))[0]
            return await self._entry(table, index, level, guess)
        return entry

    async def physical(self, pgd: int, va: int, guess: bool = False) -> int | None:
        """The physical address of user address ``va`` in the address space whose top-level
        table is at kernel address ``pgd``; None when it is not mapped (or not readable).
        ``guess``: a last-level page kept from before may say it (``reader`` checks it)."""
        table = pgd  # page-aligned on x86_64; arm64's smallest top levels share a page
        entries = self.entries
        for level in range(self.levels, 0, -1):
            shift = 12 + 9 * (level - 1)
            entry = await self._entry(table, (va >> shift) & 511, level, guess)
            if entry is None or not entry & _PRESENT:
                return None
            base = entry & entries.address
            if level in (2, 3) and bool(entry & entries.block_bit) == entries.block:
                return (base & ~((1 << shift) - 1)) + (va & ((1 << shift) - 1))
            if level == 1:
                return base + (va & (_PAGE - 1))
            table = self.direct_map + base
        return None

    def reader(self, pgd: int) -> Reader:
        """Reads of the process's user addresses (each within one page): every range
        translated first, then their bytes in one request, with the last-level table pages
        the translations guessed from ``last`` (which a second request corrects, when one
        changed)."""

        async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
            self._guessed.clear()
            places = [await self._place(pgd, addr, size) for addr, size in ranges]
            guessed = sorted(self._guessed)
            found = await self._read_at(places, [(base, _PAGE) for base in guessed])
            fresh, out = found[: len(guessed)], found[len(guessed) :]
            changed = False
            for base, page in zip(guessed, fresh, strict=True):
                assert self._last is not None
                changed |= self._last[base] != page
                self._tables[base] = self._last[base] = page
            if not changed:
                return out
            again = [await self._place(pgd, addr, size) for addr, size in ranges]
            pairs = list(zip(again, places, strict=True))
            redone = await self._read_at([p if p != q else None for p, q in pairs], [])
            return [o if p == q else r for (p, q), o, r in zip(pairs, out, redone, strict=True)]

        return read

    async def _place(self, pgd: int, addr: int, size: int) -> tuple[int, int] | None:
        """Where [addr, addr+size) is in the direct map (None: unmapped, or across pages)."""
        if (addr % _PAGE) + size > _PAGE:
            return None
        at = await self.physical(pgd, addr, guess=True)
        return None if at is None else (self.direct_map + at, size)

    async def _read_at(
        self, places: Sequence[tuple[int, int] | None], before: Sequence[tuple[int, int]]
    ) -> list[bytes | None]:
        """``before``'s bytes, then each place's (None for a place of None), in one request."""
        wanted = [p for p in places if p is not None]
        found = await self.read([*before, *wanted]) if before or wanted else []
        head, data = found[: len(before)], iter(found[len(before) :])
        return [*head, *(None if p is None else next(data) for p in places)]


def holds(root: int, pgd: int, direct_map: int) -> bool:
    """Whether the page-table root register value ``root`` (CR3) loads the tables at kernel
    address ``pgd``: its address bits (the PCID and the no-flush bit aside) are the table's
    physical address, or with page-table isolation the page after it (the user's copy of the
    top level, PTI_USER_PGTABLE_BIT: bit 12, as arch/x86 has it since 4.15). Not seen in the
    tests: their guests run QEMU's default CPU, an AMD model, which Linux does not isolate (it
    does so only for CPUs it takes as affected by Meltdown). A user-mode sample that disagrees
    drops the root it was compared with (``Spaces.forget_pgd``)."""
    table, physical = root & _ADDRESS, pgd - direct_map
    return table in (physical, physical + _PAGE)


def user_end(levels: int) -> int:
    """Where x86_64 user space ends with ``levels`` levels of page tables."""
    return 1 << (12 + 9 * levels - 1)


async def page_tables(
    read: Reader, page_offset_base: int | None, l5_enabled: int | None
) -> PageTables:
    """The page tables as this kernel lays them out: ``page_offset_base`` and
    ``__pgtable_l5_enabled`` are the runtime addresses of those variables (None: the kernel
    has none, so the direct map is at its fixed base and paging has 4 levels)."""
    levels = 4
    if l5_enabled is not None:
        (raw,) = await read([(l5_enabled, 4)])
        levels = 5 if raw is not None and int.from_bytes(raw, "little") else 4
    base = DIRECT_MAP_5 if levels == 5 else DIRECT_MAP_4
    if page_offset_base is not None:
        (raw,) = await read([(page_offset_base, 8)])
        base = base if raw is None else int.from_bytes(raw, "little")
    return PageTables(read, base, levels)


def split(kernel: Reader, user: Reader | None, shared_from: int) -> Reader:
    """Reads of a task's memory: the kernel's half through ``kernel``, the rest through
    ``user`` (its page tables; None: unreadable)."""

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        high = [r for r in ranges if r[0] >= shared_from]
        low = [r for r in ranges if r[0] < shared_from]
        found_high = iter(await kernel(high) if high else [])
        found_low = iter(await user(low) if low and user is not None else [None] * len(low))
        return [next(found_high) if r[0] >= shared_from else next(found_low) for r in ranges]

    return read
