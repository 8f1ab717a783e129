"""Processes from the Emerald metadata page, read under the sampled vCPU's CR3.

The page is read (in the sample's page cache, while the guest is stopped) when that address
space was not confirmed within the last RECHECK seconds; a new (CR3, page contents) pair means a
new process, whose ``.text`` is read once and matched against the user ELF files. A reused pid
with another program has other page contents or another CR3, so it is identified again. A
program with no matching ELF is unwound with the ``.eh_frame`` read from guest memory and named
by address. Samples without a page are identified by CR3 (``cr3.py``); with ``fallback`` (the
``auto`` guest OS), user code running without a page turns the page off for the rest of the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from qmpprof.dwarf.cfi import CfiTable
from qmpprof.guest import metadata
from qmpprof.guest.base import Identity, read_range
from qmpprof.guest.cr3 import Cr3Identifier
from qmpprof.guest.metadata import ProcessInfo
from qmpprof.guest.programs import ProgramIndex
from qmpprof.memo import Memo
from qmpprof.memory import fetch_piece
from qmpprof.model import Mapping, Process, Registers
from qmpprof.naming import UNKNOWN
from qmpprof.pages import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import Module

# The metadata page of an address space is read again once its last reading is this old
# (seconds): a new process reusing a page-table root is recognised within that time, and most
# samples need no read of it at all.
RECHECK = 0.5
_RECENT_LIMIT = 4096


class EmeraldIdentifier:
    """A GuestIdentifier for guests with the metadata page; nothing learnt is ever consumed."""

    def __init__(
        self,
        kernel_modules: Sequence[Module],
        programs: ProgramIndex,
        *,
        metadata_addr: int = metadata.METADATA_ADDR,
        layout: tuple[str, ...] = metadata.FIELDS,
        fallback: bool = True,
        recheck: float = RECHECK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.by_cr3 = Cr3Identifier(kernel_modules, programs)
        self.programs = programs
        self.metadata_addr: int | None = metadata_addr
        self.layout = layout
        self.fallback = fallback
        self.recheck = recheck
        self.clock = clock
        self._by_page: Memo[tuple[int, ProcessInfo], Identity] = Memo(_RECENT_LIMIT)
        # CR3 -> (identity, when the metadata page last confirmed it).
        self._recent: Memo[int, tuple[Identity, float]] = Memo(_RECENT_LIMIT)

    @property
    def kernel(self) -> Identity:
        return self.by_cr3.kernel

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        """The metadata page, unless this address space was identified a moment ago."""
        if self.metadata_addr is None or self._fresh(regs.cr3) is not None:
            return ()
        return ((self.metadata_addr, 8 * len(self.layout)),)

    def _fresh(self, cr3: int) -> Identity | None:
        seen = self._recent.get(cr3)
        if seen is None or self.clock() - seen[1] > self.recheck:
            return None
        return seen[0]

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        """The process ``regs.cpu`` runs; call while the guest is stopped."""
        self.by_cr3.note(regs)
        if self.metadata_addr is not None:
            fresh = self._fresh(regs.cr3)
            if fresh is not None and (fresh.process is not None or regs.cpl != 3):
                return fresh
            found = await self._from_metadata(transport, regs, cache, self.metadata_addr)
            if found is not None:
                return found
        return await self.by_cr3.identify(transport, regs, cache)

    async def _from_metadata(
        self, transport: GuestTransport, regs: Registers, cache: PageCache, addr: int
    ) -> Identity | None:
        size = 8 * len(self.layout)
        await fetch_piece(transport, cache, regs.cpu, addr, size)
        page = cache.read(addr, size)
        info = None if page is None else metadata.parse(page, self.layout)
        if info is None:
            if regs.cpl == 3:
                if self.fallback:
                    # User code runs without a page: this kernel does not follow the convention.
                    self.metadata_addr = None
                return None
            self._recent.put(regs.cr3, (self.kernel, self.clock()))
            return self.kernel
        found = self._by_page.get((regs.cr3, info))
        if found is None:
            found = self._by_page.put(
                (regs.cr3, info), await self._from_page(transport, regs, info)
            )
        self._recent.put(regs.cr3, (found, self.clock()))
        return found

    async def _from_page(
        self, transport: GuestTransport, regs: Registers, info: ProcessInfo
    ) -> Identity:
        text = await read_range(transport, regs.cpu, info.text_address, info.text_size)
        image = None if text is None else self.programs.match(text)
        if image is not None:
            bias = info.text_address - image.text_addr
            module = Module.from_image(image, kernel=False, bias=bias)
            return self.by_cr3.with_module(Process(info.pid, image.name, regs.cr3), module)
        module = await self._unknown_module(transport, regs.cpu, info, text)
        return self.by_cr3.with_module(Process(info.pid, None, regs.cr3), module)

    async def _unknown_module(
        self, transport: GuestTransport, cpu: int, info: ProcessInfo, text: bytes | None
    ) -> Module:
        """A program no ELF matched: its own ``.eh_frame`` from guest memory, and its code."""
        cfi = None
        if info.has_eh_frame:
            data = await read_range(transport, cpu, info.eh_frame_address, info.eh_frame_size)
            if data is not None:
                cfi = CfiTable.parse(data, info.eh_frame_address)
        end = info.image_base + info.image_size
        mapping = Mapping(UNKNOWN, info.image_base, end, kernel=False)
        return Module.build(mapping, cfi=cfi, code=text, code_addr=info.text_address)
