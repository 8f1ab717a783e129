"""Which process a vCPU was running, and the address space to unwind and name its stack with.

With the Emerald metadata page: the page is read under the sampled vCPU's CR3 (the sampler's
page cache, while the guest is stopped) when that address space was not confirmed within the
last RECHECK seconds; a new (CR3, page contents) pair means a new process,
whose ``.text`` is read once and matched against the user ELF files. A reused pid with another
program has other page contents or another CR3, so it is identified again. A program with no
matching ELF is unwound with the ``.eh_frame`` read from guest memory and named by address.

Without the page: address spaces are told apart by CR3. A CR3 never seen in user mode belongs to
the kernel (idle, kernel threads, boot). User ELFs are matched by reading their ``.text`` range
under that CR3; without a match the user stack is walked with frame pointers.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qmpprof.guest import metadata
from qmpprof.guest.metadata import ProcessInfo
from qmpprof.guest.programs import ProgramIndex
from qmpprof.memory import PageCache, fetch
from qmpprof.model import Process, Registers
from qmpprof.profile import UNKNOWN
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.cfi import CfiTable
from qmpprof.unwind.chain import AddressSpace, Module

UNKNOWN_PROGRAM = UNKNOWN
# The metadata page of an address space is read again once its last reading is this old
# (seconds): a new process reusing a page-table root is recognised within that time, and most
# samples need no read of it at all.
RECHECK = 0.5
_RECENT_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class Identity:
    process: Process | None
    space: AddressSpace


class ProcessTracker:
    """Identifies processes sample by sample; everything learnt is cached, nothing is consumed."""

    def __init__(
        self,
        kernel_modules: Sequence[Module],
        programs: ProgramIndex,
        *,
        metadata_addr: int | None = metadata.METADATA_ADDR,
        layout: tuple[str, ...] = metadata.FIELDS,
        recheck: float = RECHECK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kernel_modules = tuple(kernel_modules)
        self.programs = programs
        self.metadata_addr = metadata_addr
        self.layout = layout
        self.kernel = Identity(None, AddressSpace(self.kernel_modules))
        self._by_page: dict[tuple[int, ProcessInfo], Identity] = {}
        self._by_cr3: dict[int, Identity] = {}
        self._user_cr3s: set[int] = set()
        # CR3 -> (identity, when the metadata page last confirmed it).
        self._recent: dict[int, tuple[Identity, float]] = {}
        self.recheck = recheck
        self.clock = clock

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
        if regs.cpl == 3:
            self._user_cr3s.add(regs.cr3)
        if self.metadata_addr is not None:
            fresh = self._fresh(regs.cr3)
            if fresh is not None and (fresh.process is not None or regs.cpl != 3):
                return fresh
            found = await self._from_metadata(transport, regs, cache)
            if found is not None:
                return found
        if regs.cr3 not in self._user_cr3s:
            return self.kernel
        found = self._by_cr3.get(regs.cr3)
        if found is None:
            found = await self._from_cr3(transport, regs)
            self._by_cr3[regs.cr3] = found
        return found

    async def _from_metadata(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity | None:
        assert self.metadata_addr is not None
        await fetch(transport, cache, regs.cpu, self.metadata_addr, 8 * len(self.layout))
        page = cache.read(self.metadata_addr, 8 * len(self.layout))
        info = None if page is None else metadata.parse(page, self.layout)
        if info is None:
            if regs.cpl == 3:
                # User code runs without a page: this kernel does not follow the convention.
                self.metadata_addr = None
                return None
            self._remember(regs.cr3, self.kernel)
            return self.kernel
        found = self._by_page.get((regs.cr3, info))
        if found is None:
            found = await self._from_page(transport, regs, info)
            self._by_page[(regs.cr3, info)] = found
        self._remember(regs.cr3, found)
        return found

    def _remember(self, cr3: int, identity: Identity) -> None:
        if len(self._recent) >= _RECENT_LIMIT:
            self._recent.clear()
        self._recent[cr3] = (identity, self.clock())

    async def _from_page(
        self, transport: GuestTransport, regs: Registers, info: ProcessInfo
    ) -> Identity:
        text = await _read(transport, regs.cpu, info.text_address, info.text_size)
        image = None if text is None else self.programs.match(text)
        if image is not None:
            bias = info.text_address - image.text_addr
            module = Module.from_image(image, kernel=False, bias=bias)
            return self._identity(Process(info.pid, image.name, regs.cr3), module)
        module = await self._unknown_module(transport, regs.cpu, info, text)
        return self._identity(Process(info.pid, None, regs.cr3), module)

    async def _unknown_module(
        self, transport: GuestTransport, cpu: int, info: ProcessInfo, text: bytes | None
    ) -> Module:
        cfi = None
        if info.has_eh_frame:
            data = await _read(transport, cpu, info.eh_frame_address, info.eh_frame_size)
            if data is not None:
                cfi = CfiTable.parse(data, info.eh_frame_address)
        return Module(
            name=UNKNOWN_PROGRAM,
            start=info.image_base,
            end=info.image_base + info.image_size,
            kernel=False,
            bias=0,
            symbols=None,
            cfi=cfi,
            code=text,
            code_addr=info.text_address,
        )

    async def _from_cr3(self, transport: GuestTransport, regs: Registers) -> Identity:
        for image in self.programs.images:
            text = await _read(transport, regs.cpu, image.text_addr, image.text_size)
            if text is not None and hashlib.sha256(text).hexdigest() == image.text_sha256:
                module = Module.from_image(image, kernel=False)
                return self._identity(Process(None, image.name, regs.cr3), module)
        return Identity(Process(None, None, regs.cr3), self.kernel.space)

    def _identity(self, process: Process, user: Module) -> Identity:
        return Identity(process, AddressSpace([*self.kernel_modules, user]))


async def _read(transport: GuestTransport, cpu: int, addr: int, size: int) -> bytes | None:
    """Bytes of a guest range, or None if any of it is unmapped (not yet faulted in, say)."""
    if size == 0:
        return None
    cache = PageCache()
    await fetch(transport, cache, cpu, addr, size)
    return cache.read(addr, size)
