"""Guest memory as the unwinder sees it: the pages one sample fetched, and ``PageMissing``.

The unwinder is synchronous and never touches the transport. It reads through a ``PageCache``;
when it asks for a page the cache has not fetched yet, ``PageMissing`` tells the sampler which
page to fetch (while the guest is still stopped), and the sampler runs the unwind again.
Unwinding costs microseconds, a round trip to QEMU a fraction of a millisecond, so restarting
is cheaper than making the unwinder asynchronous.
"""

from __future__ import annotations

import struct

PAGE = 4096
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_NOT_HERE = object()
_PAGE_MASK = ~(PAGE - 1)


class PageMissing(Exception):
    """The page holding ``addr`` has not been fetched yet."""

    def __init__(self, addr: int) -> None:
        super().__init__(f"page {addr & ~(PAGE - 1):#x} not fetched")
        self.addr = addr


def page_of(addr: int) -> int:
    return addr & ~(PAGE - 1)


class PageCache:
    """Guest memory of one vCPU's address space fetched during one sample.

    Three kinds of holdings. The stack ``window``: bytes from about RSP up to what walks from
    there need, at any address (over a gdbstub every 2 KiB is a packet: the bytes below RSP
    and past the walk's last read are not worth them); reads within it raise ``top``, the
    highest byte any read reached. ``pages``: a page maps to its bytes, or to None when QEMU
    said it is not mapped. ``pieces``: reads smaller than a page (a pointer, a few fields, the
    part of a user stack a walk read last time): start address -> size and bytes, or None when
    unmapped. ``used`` holds, per page read outside the window, the lowest and highest offsets
    read there (the stack reader learns from it where walks go). ``asked``, while a list: the
    ranges a reader over this cache (``memory.held``) was asked for.
    """

    __slots__ = ("asked", "data", "hi", "lo", "pages", "pieces", "top", "used")

    def __init__(self) -> None:
        self.pages: dict[int, bytes | None] = {}
        self.pieces: dict[int, tuple[int, bytes | None]] = {}
        self.used: dict[int, list[int]] = {}
        self.lo = self.hi = self.top = 0  # the window is [lo, hi)
        self.data = b""
        self.asked: list[tuple[int, int]] | None = None

    def above(self, boundary: int) -> PageCache:
        """A cache of what this one holds at or above ``boundary`` (the kernel's memory, the
        same in every address space), for a walk whose user memory must be read otherwise."""
        kept = PageCache()
        if self.lo >= boundary:
            kept.put_window(self.lo, self.data)
        kept.pages = {page: data for page, data in self.pages.items() if page >= boundary}
        kept.pieces = {at: piece for at, piece in self.pieces.items() if at >= boundary}
        return kept

    def put_window(self, addr: int, data: bytes) -> None:
        """The stack window: ``data`` read at ``addr``."""
        self.lo, self.hi, self.data, self.top = addr, addr + len(data), data, addr

    def has(self, addr: int, size: int) -> bool:
        """Whether [addr, addr+size) is fetched (in the window, as pages or a piece), mapped
        or not."""
        if self.lo <= addr and addr + size <= self.hi:
            return True
        if self._piece(addr, size) is not _NOT_HERE:
            return True
        return all(p in self.pages for p in range(page_of(addr), addr + size, PAGE))

    def _piece(self, addr: int, size: int) -> object:  # bytes, None or _NOT_HERE
        for start, (length, data) in self.pieces.items():
            if start <= addr and addr + size <= start + length:
                return None if data is None else data[addr - start : addr - start + size]
        return _NOT_HERE

    def _note(self, page: int, low: int, high: int) -> None:
        span = self.used.get(page)
        if span is None:
            self.used[page] = [low, high]
            return
        if low < span[0]:
            span[0] = low
        if high > span[1]:
            span[1] = high

    def read(self, addr: int, size: int) -> bytes | None:
        """Bytes at ``addr``; None if any page is unmapped; PageMissing if one is not fetched."""
        end = addr + size
        lo = self.lo
        if lo <= addr and end <= self.hi:
            if end > self.top:
                self.top = end
            return self.data[addr - lo : end - lo]
        first = page_of(addr)
        off = addr - first
        if off + size <= PAGE:
            try:
                page = self.pages[first]
            except KeyError:
                return self._from_piece(addr, size)
            if page is None:
                return None
            self._note(first, off, off + size)
            return page[off : off + size]
        out = bytearray()
        pos = addr
        while pos < end:
            base = page_of(pos)
            take = min(end, base + PAGE) - pos
            try:
                page = self.pages[base]
            except KeyError:
                return self._from_piece(addr, size, pos)
            if page is None:
                return None
            self._note(base, pos - base, pos - base + take)
            out += page[pos - base : pos - base + take]
            pos += take
        return bytes(out)

    def _from_piece(self, addr: int, size: int, missing: int | None = None) -> bytes | None:
        data = self._piece(addr, size) if self.pieces else _NOT_HERE
        if data is _NOT_HERE:
            raise PageMissing(addr if missing is None else missing)
        assert data is None or isinstance(data, bytes)
        if data is not None:
            pos, end = addr, addr + size
            while pos < end:
                base = page_of(pos)
                take = min(end, base + PAGE)
                self._note(base, pos - base, take - base)
                pos = take
        return data

    def read_u64(self, addr: int) -> int | None:
        # The unwinder's most frequent call: a word in the window, or within one fetched page,
        # unpacked in place.
        lo = self.lo
        if lo <= addr and addr + 8 <= self.hi:
            if addr + 8 > self.top:
                self.top = addr + 8
            return int(_U64.unpack_from(self.data, addr - lo)[0])
        base = addr & _PAGE_MASK
        off = addr - base
        for start, (length, data) in self.pieces.items():  # the stack reader's: a few at most
            if start <= addr and addr + 8 <= start + length:
                if data is None:
                    return None
                self._note(base, off, off + 8)
                return int(_U64.unpack_from(data, addr - start)[0])
        if off <= PAGE - 8 and base in self.pages:
            page = self.pages[base]
            if page is None:
                return None
            self._note(base, off, off + 8)
            return int(_U64.unpack_from(page, off)[0])
        data = self.read(addr, 8)
        return None if data is None else _U64.unpack(data)[0]

    def read_u32(self, addr: int) -> int | None:
        """A 4-byte word (an i386 stack slot)."""
        data = self.read(addr, 4)
        return None if data is None else _U32.unpack(data)[0]
