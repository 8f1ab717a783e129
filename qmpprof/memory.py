"""Guest memory for one sample over a transport: page-split reads into the sample's ``PageCache``,
and the stack-reading policy (one window at SP, cut at the stack's end once known; the pages the
unwinder asks for, a bounded number per sample)."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from qmpprof.errors import MemoryReadError, TransportError
from qmpprof.memo import Memo
from qmpprof.model import Registers
from qmpprof.pagecache import PAGE, PageCache, PageMissing, page_of
from qmpprof.transport.base import GuestTransport

# Stack bytes read at SP in one call: a QMP memsave costs about the same for 4 or 64 KiB. A
# transport whose reads cost by size says its own, smaller window (transport/kinds.py).
WINDOW = 16384
MAX_REFETCH = 8  # pages fetched on the unwinder's demand per sample
# Pages after one fetched on demand through a task's page tables that come with it (a walk
# needs the pages above the one it lacks: arm64's user stacks under a system call, 1-3 pages
# each in the aarch64 test guest's 5 s profile), the first time at a stack; then as many as the
# last walk from there used (riscv64's xz under system calls: 1.2 pages of the 3.5 fetched).
THROUGH_AHEAD = 2
MAX_BEYOND = 4  # pieces outside the window fetched with it because the last walk there read them
# The kernel memory the last walk from a stack read through a task's page tables (riscv64 and
# arm64 read no user page in kernel mode: the entries and the user stack's pages in the linear
# map) is fetched with the next window there, up to this much: the pages a first walk through
# them fetches, and their entries.
MAX_THROUGH = (1 + THROUGH_AHEAD) * PAGE + PAGE // 8
ALIGN = 64  # a window starts at SP rounded down to this
SLACK = 256  # bytes a window reaches past the highest byte walks from its SP page read
PIECE = 2048  # bytes read around what a walk read beyond its window (one gdbstub packet)
_STACK_ENDS_LIMIT = 4096

T = TypeVar("T")


async def fetch(
    transport: GuestTransport, cache: PageCache, cpu: int, addr: int, size: int
) -> None:
    """Fetch the pages covering [addr, addr+size) into ``cache``, in as few reads as possible.

    Contiguous missing pages are read in one call; if that call fails (some page unmapped), the
    run is split page by page so that the mapped pages are still cached and the unmapped ones
    are remembered as None.
    """
    start = page_of(addr)
    end = min(page_of(addr + size - 1) + PAGE, 1 << 64)
    missing = [p for p in range(start, end, PAGE) if p not in cache.pages]
    for run_start, run_len in _runs(missing):
        try:
            data = await transport.read(cpu, run_start, run_len * PAGE)
        except MemoryReadError:
            if run_len == 1:
                cache.pages[run_start] = None
                continue
            for i in range(run_len):
                page = run_start + i * PAGE
                try:
                    cache.pages[page] = await transport.read(cpu, page, PAGE)
                except MemoryReadError:
                    cache.pages[page] = None
            continue
        for i in range(run_len):
            cache.pages[run_start + i * PAGE] = data[i * PAGE : (i + 1) * PAGE]


async def fetch_piece(read: Reader, cache: PageCache, addr: int, size: int) -> None:
    """Fetch just [addr, addr+size) into ``cache`` (a pointer, a few fields, under a page),
    unless the cache has it: over a gdbstub a page is two 2 KiB packets where 8 bytes are one
    short one."""
    if not cache.has(addr, size):
        cache.pieces[addr] = (size, await read_one(read, addr, size))


# Guest memory as a guest OS reads it: ranges in, each range's bytes out (None: not mapped).
Reader = Callable[[Sequence[tuple[int, int]]], Awaitable[list[bytes | None]]]


def reader(transport: GuestTransport, cpu: int) -> Reader:
    """Reads of ``transport`` as ``cpu`` sees memory, issued together (one request where the
    transport can). Ranges of size 0 read as None."""

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        wanted = [(a, n) for a, n in ranges if n > 0]
        found = iter(await transport.read_many(cpu, wanted) if wanted else [])
        return [None if n <= 0 else _bytes(next(found)) for _, n in ranges]

    return read


def held(read: Reader, cache: PageCache) -> Reader:
    """``read`` answering first from what ``cache`` holds (the pieces fetched with a stack
    window), reading the rest in one request; while ``cache.asked`` is a list, each range
    asked is noted there."""

    async def read_held(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        if cache.asked is not None:
            cache.asked.extend((a, n) for a, n in ranges if n > 0)
        rest = [i for i, (a, n) in enumerate(ranges) if n <= 0 or not cache.has(a, n)]
        found = iter(await read([ranges[i] for i in rest]) if rest else [])
        lacking = set(rest)
        return [
            next(found) if i in lacking else cache.read(a, n) for i, (a, n) in enumerate(ranges)
        ]

    return read_held


def kernel_reader(transport: GuestTransport, cpus: Sequence[int]) -> Reader:
    """Reads of kernel memory through the first of ``cpus``, and what it could not read
    through the next ones in turn: a vCPU in user mode may not see the kernel (arm64 Linux
    unmaps it at EL0 under KPTI)."""
    reads = [reader(transport, cpu) for cpu in cpus]

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        found = await reads[0](ranges)
        for other in reads[1:]:
            missing = [i for i, data in enumerate(found) if data is None and ranges[i][1] > 0]
            if not missing:
                break
            again = await other([ranges[i] for i in missing])
            for i, data in zip(missing, again, strict=True):
                found[i] = data
        return found

    return read


async def read_ints(read: Reader, fields: Sequence[tuple[int, int]]) -> list[int | None]:
    """Little-endian unsigned integers at (address, size) pairs, read together; None where
    unmapped."""
    found = await read(fields)
    return [None if raw is None else int.from_bytes(raw, "little") for raw in found]


async def read_one(read: Reader, addr: int, size: int) -> bytes | None:
    (found,) = await read([(addr, size)])
    return found


def _bytes(found: bytes | MemoryReadError) -> bytes | None:
    return found if isinstance(found, bytes) else None


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] * PAGE == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


class StackReader:
    """Reads the stack of each sampled vCPU: the window at SP in one read, and the pages the
    unwinder asks for.

    The window starts at SP (rounded down to ALIGN bytes: walks read nothing below it) and
    ends, the first time at an SP page, a ``window``'s reach above that page; after that at
    the highest byte walks from that page read, plus SLACK. Over the gdbstub every 2 KiB costs
    a packet QEMU answers in turn, and a walk from SP rarely needs more than 1-2 KiB of the
    first window; a walk that needs more fetches the page on demand, and the window grows to
    it. What a walk read beyond the window's reach (the user stack under a system call's kernel
    frames) is fetched with the next window at that SP page, in the same round trip, as a
    piece of about one packet around the bytes read, rather than one more round trip later.

    memsave fails whole if one page is unmapped, and a failed read costs as much as a good one;
    so when the window fails, it is read page by page up to the first unmapped page (the top of
    the stack), once: later samples at this SP page read just up to there.
    """

    def __init__(
        self, transport: GuestTransport, window: int = WINDOW, max_refetch: int = MAX_REFETCH
    ) -> None:
        self.transport = transport
        self.window = window
        self.max_refetch = max_refetch
        self._stack_ends: Memo[tuple[int, int], int] = Memo(_STACK_ENDS_LIMIT)
        self._deepest: Memo[tuple[int, int], int] = Memo(_STACK_ENDS_LIMIT)
        self._beyond: Memo[tuple[int, int], tuple[tuple[int, int], ...]] = Memo(_STACK_ENDS_LIMIT)
        # Per stack, the pages after a missing one the last walk through page tables used.
        self._ahead: Memo[tuple[int, int], int] = Memo(_STACK_ENDS_LIMIT)
        # Per stack, the first page its last walk read through a task's page tables, and the
        # kernel memory it read to do so.
        self._first: Memo[tuple[int, int], int] = Memo(_STACK_ENDS_LIMIT)
        self._through: Memo[tuple[int, int], tuple[tuple[int, int], ...]] = Memo(_STACK_ENDS_LIMIT)

    async def prefetch(
        self,
        regs: Registers,
        cache: PageCache,
        also: Sequence[tuple[int, int]] = (),
        into: PageCache | None = None,
    ) -> None:
        """The stack window at SP, and in the same request what the last walk from this SP
        page read beyond it (a system call's user stack beneath the kernel's) and the pieces
        ``also`` (the identifier's: into ``into``, with what the last walk from here read
        through page tables). ``cache`` and ``into`` are the sample's fresh caches."""
        key = _stack_key(regs)
        lo, end = self._window_range(regs, key)
        # Where the stack ends is not known yet: the window goes page by page (in the same
        # request), so that an unmapped page above the stack fails alone.
        known = key in self._stack_ends or key in self._deepest
        window = [(lo, end - lo)] if known else _by_page(lo, end)
        beyond = self._beyond.get(key, ())
        # Not for user code, which reads no kernel page (riscv64 keys its user stacks as the
        # entry's first instructions do theirs: the same sp, space 0).
        through = () if regs.user else self._through.get(key, ())
        wanted = () if into is None else (*also, *through)
        try:
            found = await self.transport.read_many(regs.cpu, [*window, *beyond, *wanted])
        except TransportError:
            self._stack_ends.pop(key, None)
            await self._read_up_to_hole(regs.cpu, cache, page_of(regs.sp), end)
            read = reader(self.transport, regs.cpu)
            for a, n in beyond:
                await fetch_piece(read, cache, a, n)
            for a, n in wanted:
                assert into is not None
                await fetch_piece(read, into, a, n)
            return
        await self._take_window(regs, cache, key, window, found[: len(window)])
        found = found[len(window) :]
        for (a, n), data in zip(beyond, found[: len(beyond)], strict=True):
            cache.pieces[a] = (n, data if isinstance(data, bytes) else None)
        if into is not None:
            for (a, n), data in zip(wanted, found[len(beyond) :], strict=True):
                into.pieces[a] = (n, data if isinstance(data, bytes) else None)

    def _window_range(self, regs: Registers, key: tuple[int, int]) -> tuple[int, int]:
        lo = regs.sp & ~(ALIGN - 1)
        end = min(page_of(regs.sp + self.window - 1) + PAGE, 1 << 64)
        end = min(end, self._stack_ends.get(key, end))
        deepest = self._deepest.get(key)
        if deepest is not None:
            # An SP higher in its page than the deepest byte earlier walks from it read still
            # gets its SLACK (never a window that ends below its start).
            end = min(end, _align_up(max(deepest, regs.sp) + SLACK))
        return lo, max(end, lo)

    async def _take_window(
        self,
        regs: Registers,
        cache: PageCache,
        key: tuple[int, int],
        window: list[tuple[int, int]],
        found: list[bytes | MemoryReadError],
    ) -> None:
        """The window's bytes from its reads, up to the first that failed: the page where
        that one could read no further is the hole (the top of the stack)."""
        taken: list[bytes] = []
        for (addr, _), data in zip(window, found, strict=True):
            if isinstance(data, bytes):
                taken.append(data)
                continue
            self._stack_ends.pop(key, None)  # the mapping changed (or was never known)
            readable = data.readable or b""
            if len(window) == 1 and not readable:
                await self._read_up_to_hole(regs.cpu, cache, page_of(regs.sp), addr + data.size)
                return
            taken.append(readable)
            cache.pages[page_of(addr + len(readable) + PAGE - 1)] = None
            break
        cache.put_window(window[0][0], b"".join(taken))

    async def _read_up_to_hole(self, cpu: int, cache: PageCache, start: int, end: int) -> None:
        for page in range(start, end, PAGE):
            try:
                cache.pages[page] = await self.transport.read(cpu, page, PAGE)
            except MemoryReadError:
                cache.pages[page] = None
                return

    def learn(
        self,
        regs: Registers,
        cache: PageCache,
        floor: int = 0,
        through: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Remember the first unmapped page above SP that this sample met, the highest byte
        its walk read near SP, what it read beyond the window's reach at or above ``floor``
        (below it, user memory the walk read otherwise than as the vCPU sees it: a window
        there would not read it) and the kernel memory it read to do so (``through``: page
        tables, the linear map), when that is not more than MAX_THROUGH."""
        key = _stack_key(regs)
        kept = tuple(dict.fromkeys(through))
        if kept and sum(n for _, n in kept) <= MAX_THROUGH:
            self._through.put(key, kept)
        else:
            self._through.pop(key, None)
        start = page = page_of(regs.sp)
        while page < cache.hi or cache.pages.get(page) is not None:
            page += PAGE
        if page in cache.pages:
            self._stack_ends.put(key, page)
        # Bytes read within a window's reach of SP (walks skip pages under large frames).
        reach = start + self.window + PAGE
        used = cache.used
        deepest = max(
            (p + span[1] for p, span in used.items() if start <= p < reach),
            default=regs.sp + 8,
        )
        deepest = max(deepest, cache.top)
        if deepest > self._deepest.get(key, -1):
            self._deepest.put(key, deepest)
        # Beyond that reach, for the next sample here; a guess that missed is dropped for one
        # sample (an interrupt stack leads to whichever task it interrupted).
        guessed = self._beyond.get(key, ())
        beyond = sorted(
            _around(p + span[0], p + span[1])
            for p, span in used.items()
            if not start <= p < reach and p >= floor
        )
        if guessed and not any(page_of(a) in used for a, _ in guessed):
            beyond = []
        self._beyond.put(key, tuple(beyond[:MAX_BEYOND]))

    async def complete(
        self,
        regs: Registers,
        cache: PageCache,
        attempt: Callable[[], T],
        through: Reader | None = None,
    ) -> T:
        """``attempt()`` (a pure walk over ``cache``) run until it needs no page it lacks: each
        ``PageMissing`` fetches that page and runs it again. Past ``max_refetch`` pages a missing
        page counts as unmapped, so the walk stops there, truncated. Pages are read through
        ``through`` when given (not as the vCPU sees memory), with the pages after each that the
        last walk from this stack used (THROUGH_AHEAD the first time)."""
        fetched = 0
        key = _stack_key(regs)
        ahead = self._ahead.get(key, THROUGH_AHEAD)
        firsts: list[int] = []  # the pages missing when asked for, through page tables
        first = self._first.get(key)
        if through is not None and first is not None:
            # The page the last walk from here lacked first, before the walk asks: not one
            # walk more (its bytes likely came with the window, ``prefetch``).
            fetched += 1
            firsts.append(first)
            await _fetch_through(cache, first, ahead, through)
        while True:
            try:
                found = attempt()
            except PageMissing as miss:
                page = page_of(miss.addr)
                if page in cache.pages:
                    raise TransportError(f"the unwinder asked again for page {page:#x}") from miss
                if fetched < self.max_refetch:
                    fetched += 1
                    if through is not None:
                        firsts.append(page)
                        await _fetch_through(cache, page, ahead, through)
                    else:
                        await fetch(self.transport, cache, regs.cpu, page, PAGE)
                else:
                    cache.pages[page] = None
                continue
            if firsts:
                self._ahead.put(key, _pages_used_after(firsts, cache))
            used = [p for p in firsts if p in cache.used]
            if used:
                self._first.put(key, used[0])
            else:
                self._first.pop(key, None)
            return found


async def _fetch_through(cache: PageCache, page: int, ahead: int, through: Reader) -> None:
    """``page`` read through ``through`` into ``cache`` and, in the same request, ``ahead``
    pages after it (a walk goes up the stack)."""
    pages = [page + i * PAGE for i in range(1 + ahead)]
    pages = [p for p in pages if p not in cache.pages and p < 1 << 64]
    cache.pages.update(zip(pages, await through([(p, PAGE) for p in pages]), strict=True))


def _pages_used_after(firsts: Sequence[int], cache: PageCache) -> int:
    """How many pages after one of ``firsts`` (fetched with THROUGH_AHEAD more) a walk read,
    at most."""
    reach = (1 + THROUGH_AHEAD) * PAGE
    return max(
        ((p - first) // PAGE for first in firsts for p in cache.used if first <= p < first + reach),
        default=0,
    )


def _by_page(lo: int, end: int) -> list[tuple[int, int]]:
    """[lo, end) cut at page boundaries, as (start, size) ranges."""
    cuts = [lo, *range(page_of(lo) + PAGE, end, PAGE), end]
    return [(a, b - a) for a, b in itertools.pairwise(cuts) if b > a]


def _align_up(addr: int) -> int:
    return min(-(-addr // ALIGN) * ALIGN, 1 << 64)


def _around(low: int, high: int) -> tuple[int, int]:
    """A piece of about one gdbstub packet (PIECE bytes) around [low, high), within its page:
    where the next walk will likely read (start, size)."""
    page = page_of(low)
    spare = max(0, PIECE - (high - low)) // 2
    start = max(page, (low - spare) & ~(ALIGN - 1))
    end = min(page + PAGE, max(high, start + PIECE))
    start = max(page, min(start, (end - PIECE) & ~(ALIGN - 1)))  # cut by the page's end
    return start, end - start


def _stack_key(regs: Registers) -> tuple[int, int]:
    # Kernel stacks look the same in every address space; user stacks belong to their own. A
    # vCPU that translates nothing (firmware: riscv64's M-mode with the interrupted user sp)
    # reads its SP's page physically: what it finds there tells nothing of the stack's.
    if not regs.special.get("paging", 1):
        return (-1, page_of(regs.sp))
    return (regs.space if regs.user else 0, page_of(regs.sp))
