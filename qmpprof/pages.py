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
    """Pages of one vCPU's address space fetched during one sample.

    A page maps to its bytes, or to None when QEMU said it is not mapped. ``used`` holds the
    pages something read from (the stack reader learns from it how much of a window a walk
    needs). ``pieces`` are reads smaller than a page (a pointer, a few fields: over a gdbstub a
    whole page is two 2 KiB packets): start address -> size and bytes, or None when unmapped.
    """

    __slots__ = ("pages", "pieces", "used")

    def __init__(self) -> None:
        self.pages: dict[int, bytes | None] = {}
        self.pieces: dict[int, tuple[int, bytes | None]] = {}
        self.used: set[int] = set()

    def has(self, addr: int, size: int) -> bool:
        """Whether [addr, addr+size) is fetched (as pages or a piece), mapped or not."""
        if self._piece(addr, size) is not _NOT_HERE:
            return True
        return all(p in self.pages for p in range(page_of(addr), addr + size, PAGE))

    def _piece(self, addr: int, size: int) -> object:  # bytes, None or _NOT_HERE
        for start, (length, data) in self.pieces.items():
            if start <= addr and addr + size <= start + length:
                return None if data is None else data[addr - start : addr - start + size]
        return _NOT_HERE

    def read(self, addr: int, size: int) -> bytes | None:
        """Bytes at ``addr``; None if any page is unmapped; PageMissing if one is not fetched."""
        first = page_of(addr)
        off = addr - first
        if off + size <= PAGE:
            try:
                page = self.pages[first]
            except KeyError:
                return self._from_piece(addr, size)
            self.used.add(first)
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
                return self._from_piece(addr, size, pos)
            self.used.add(base)
            if page is None:
                return None
            out += page[pos - base : pos - base + take]
            pos += take
        return bytes(out)

    def _from_piece(self, addr: int, size: int, missing: int | None = None) -> bytes | None:
        data = self._piece(addr, size) if self.pieces else _NOT_HERE
        if data is _NOT_HERE:
            raise PageMissing(addr if missing is None else missing)
        assert data is None or isinstance(data, bytes)
        return data

    def read_u64(self, addr: int) -> int | None:
        # The unwinder's most frequent call: a word within one fetched page, unpacked in place.
        base = addr & _PAGE_MASK
        if addr - base <= PAGE - 8 and base in self.pages:
            page = self.pages[base]
            self.used.add(base)
            return None if page is None else int(_U64.unpack_from(page, addr - base)[0])
        data = self.read(addr, 8)
        return None if data is None else _U64.unpack(data)[0]

    def read_u32(self, addr: int) -> int | None:
        """A 4-byte word (an i386 stack slot)."""
        data = self.read(addr, 4)
        return None if data is None else _U32.unpack(data)[0]
