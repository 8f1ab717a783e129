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
    """What a page-table entry says: its output address bits (shifted left by ``shift``: 0
    where they sit at the address's own place), and the bits that in a level-2 or level-3 entry
    tell a block (a page of 1 GiB or 2 MiB) from a table, when ``block`` is whether any is set
    there."""

    address: int
    block_bit: int
    block: bool
    shift: int = 0


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
        kept: dict[int, bytes | None] | None = None,
        span: int | None = None,
    ) -> None:
        """``end``: where user space ends (None: half of what the levels translate, as on
        x86_64: 2^47 with four levels, 2^56 with five). ``span``: the addresses a top-level
        table translates, taken below it (None: ``end``, as arm64's, whose kernel half has a
        table of its own; riscv64's kernel half is in every process's table, above ``end``).
        ``kept``: table pages of any level kept by the caller across walkers, used only as
        guesses: ``reader`` reads every entry a guess gave again in the request that reads the
        data, and walks again what changed (so a user page costs one request, not one per level
        and another for the data)."""
        self.read = read
        self.direct_map = direct_map
        self.levels = levels
        self.entries = entries
        self.user_end = user_end(levels) if end is None else end
        self.span = self.user_end if span is None else span
        self._tables: dict[int, bytes | None] = {}  # a table's kernel address -> its page
        self._kept = kept
        self._guessed: dict[int, int | None] = {}  # an entry's address -> what a guess said
        self._sure: dict[int, int] = {}  # and what it was read again to be, in this pause

    def over(self, read: Reader) -> PageTables:
        """The same tables walked through ``read`` (a pause's reads, say), nothing kept."""
        return PageTables(
            read, self.direct_map, self.levels, self.entries, self.user_end, span=self.span
        )

    def forget(self) -> None:
        """Drop the table pages read so far (page tables change as processes run)."""
        self._tables.clear()

    async def _entry(self, table: int, index: int, guess: bool = False) -> int | None:
        at = table + 8 * index
        if at in self._sure:
            return self._sure[at]
        base = at & ~(_PAGE - 1)
        pages = self._tables
        if guess and base not in pages and self._kept and base in self._kept:
            pages = self._kept
        elif base not in pages:
            (pages[base],) = await self.read([(base, _PAGE)])
            if self._kept is not None:
                self._kept[base] = pages[base]
        page = pages[base]
        offset = at - base
        entry = None if page is None else int.from_bytes(page[offset : offset + 8], "little")
        if pages is self._kept:
            self._guessed[at] = entry
        return entry

    async def physical(self, pgd: int, va: int, guess: bool = False) -> int | None:
        """The physical address of user address ``va`` in the address space whose top-level
        table is at kernel address ``pgd``; None when it is not mapped (or not readable).
        ``guess``: table pages kept from before may say it (``reader`` checks what they said)."""
        table = pgd  # page-aligned on x86_64; arm64's smallest top levels share a page
        entries = self.entries
        for level in range(self.levels, 0, -1):
            shift = 12 + 9 * (level - 1)
            entry = await self._entry(table, (va >> shift) & 511, guess)
            if entry is None or not entry & _PRESENT:
                return None
            base = (entry & entries.address) << entries.shift
            if level in (2, 3) and bool(entry & entries.block_bit) == entries.block:
                return (base & ~((1 << shift) - 1)) + (va & ((1 << shift) - 1))
            if level == 1:
                return base + (va & (_PAGE - 1))
            table = self.direct_map + base
        return None

    def reader(self, pgd: int) -> Reader:
        """Reads of the process's user addresses (each within one page): every range
        translated first, through the kept pages where they hold its tables, then their bytes
        in one request with every entry those pages gave read again; where one changed (a page
        moved by copy-on-write after a fork, a table freed and reused), the walk is made again
        on fresh pages and what moved is read again: a stale page is never returned."""

        async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
            self._guessed.clear()
            self._sure.clear()
            places = [await self._place(pgd, addr, size, True) for addr, size in ranges]
            guessed = list(self._guessed.items())
            found = await self._read_at(places, [(at, 8) for at, _ in guessed])
            fresh, out = found[: len(guessed)], found[len(guessed) :]
            changed = False
            for (at, entry), now in zip(guessed, fresh, strict=True):
                value = None if now is None else int.from_bytes(now, "little")
                if value != entry:
                    changed = True
                    self._correct(at, now)
                if value is not None:
                    self._sure[at] = value
            if not changed:
                return out
            again = [await self._place(pgd, addr, size, False) for addr, size in ranges]
            pairs = list(zip(again, places, strict=True))
            redone = await self._read_at([p if p != q else None for p, q in pairs], [])
            return [o if p == q else r for (p, q), o, r in zip(pairs, out, redone, strict=True)]

        return read

    def _correct(self, at: int, entry: bytes | None) -> None:
        """The kept page holding the entry at ``at`` made to say ``entry`` now (None: it could
        not be read, the page is dropped)."""
        assert self._kept is not None
        base = at & ~(_PAGE - 1)
        page = self._kept.get(base)
        if page is None or entry is None:
            self._kept.pop(base, None)
            return
        offset = at - base
        self._kept[base] = page[:offset] + entry + page[offset + 8 :]

    async def _place(self, pgd: int, addr: int, size: int, guess: bool) -> tuple[int, int] | None:
        """Where [addr, addr+size) is in the direct map (None: unmapped, or across pages)."""
        if (addr % _PAGE) + size > _PAGE:
            return None
        at = await self.physical(pgd, addr, guess)
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
