"""Guest memory for one sample: page-split reads over a transport, and a per-sample page cache.

The unwinder is synchronous and never touches the transport. It reads through a ``PageCache``;
when it asks for a page the cache has not fetched yet, ``PageMissing`` tells the sampler which
page to fetch (while the guest is still stopped), and the sampler runs the unwind again.
Unwinding costs microseconds, a round trip to QEMU a fraction of a millisecond, so restarting
is cheaper than making the unwinder asynchronous.
"""

from __future__ import annotations

import struct

from qmpprof.errors import MemoryReadError
from qmpprof.transport.base import GuestTransport

PAGE = 4096
_U64 = struct.Struct("<Q")


class PageMissing(Exception):
    """The page holding ``addr`` has not been fetched yet."""

    def __init__(self, addr: int) -> None:
        super().__init__(f"page {addr & ~(PAGE - 1):#x} not fetched")
        self.addr = addr


def page_of(addr: int) -> int:
    return addr & ~(PAGE - 1)


class PageCache:
    """Pages of one vCPU's address space fetched during one sample.

    A page maps to its bytes, or to None when QEMU said it is not mapped.
    """

    __slots__ = ("pages",)

    def __init__(self) -> None:
        self.pages: dict[int, bytes | None] = {}

    def read(self, addr: int, size: int) -> bytes | None:
        """Bytes at ``addr``; None if any page is unmapped; PageMissing if one is not fetched."""
        first = page_of(addr)
        off = addr - first
        if off + size <= PAGE:
            try:
                page = self.pages[first]
            except KeyError:
                raise PageMissing(addr) from None
            return None if page is None else page[off : off + size]
        out = bytearray()
        pos = addr
        end = addr + size
        while pos < end:
            base = page_of(pos)
            take = min(end, base + PAGE) - pos
            try:
                page = self.pages[base]
            except KeyError:
                raise PageMissing(pos) from None
            if page is None:
                return None
            out += page[pos - base : pos - base + take]
            pos += take
        return bytes(out)

    def read_u64(self, addr: int) -> int | None:
        data = self.read(addr, 8)
        return None if data is None else _U64.unpack(data)[0]


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


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] * PAGE == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs
