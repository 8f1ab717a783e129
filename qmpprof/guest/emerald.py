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

from qmpprof import bounds
from qmpprof.arch.base import InstructionSet
from qmpprof.dwarf.cfi import CfiTable
from qmpprof.elf.image import ElfImage
from qmpprof.guest import metadata
from qmpprof.guest.base import Attached, GuestOption, GuestSpec, Identity, KernelFile
from qmpprof.guest.cr3 import Cr3Identifier, load_files
from qmpprof.guest.metadata import ProcessInfo
from qmpprof.guest.programs import ProgramIndex
from qmpprof.memo import Memo
from qmpprof.memory import fetch_piece, read_one, reader
from qmpprof.model import Mapping, Process, Registers
from qmpprof.naming import UNKNOWN
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import Module

# The metadata page of an address space is read again once its last reading is this old
# (seconds): a new process reusing a page-table root is recognised within that time, and most
# samples need no read of it at all.
RECHECK = 0.5
_RECENT_LIMIT = 4096


class EmeraldOs:
    """``--os emerald``; ``auto`` takes it for a 64-bit kernel ELF or none (the page is a
    64-bit convention), then turning the page off for good once user code runs without one.
    Its options: ``metadata_addr`` (where the page is) and ``metadata_layout`` (its fields)."""

    name = "emerald"
    options = (
        GuestOption(
            "metadata_addr",
            "ADDR",
            f"address of the guest's process-metadata page (default {metadata.METADATA_ADDR:#x})",
            kind="value",
            read=bounds.address,
        ),
        GuestOption(
            "metadata_layout",
            "FIELDS",
            f"its u64 words in order, _ to skip one (default {','.join(metadata.FIELDS)})",
            kind="value",
            read=metadata.parse_layout,
        ),
    )

    def recognises(self, kernel: KernelFile | None) -> bool:
        return kernel is None or (kernel.arch is not None and kernel.arch.address_size == 8)

    def load(self, spec: GuestSpec) -> EmeraldIdentifier:
        modules, programs, image = load_files(spec)
        addr = spec.options.get("metadata_addr", metadata.METADATA_ADDR)
        layout = spec.options.get("metadata_layout", metadata.FIELDS)
        assert isinstance(addr, int) and isinstance(layout, tuple)
        return EmeraldIdentifier(
            modules, programs, spec.arch, metadata_addr=addr, layout=layout,
            fallback=spec.auto, kernel_file=image,
        )  # fmt: skip


class EmeraldIdentifier:
    """A Guest with the metadata page; nothing learnt is ever consumed. The firmware and the
    kernel file's check are ``Cr3Identifier``'s (``kernel_file``)."""

    def __init__(
        self,
        kernel_modules: Sequence[Module],
        programs: ProgramIndex,
        arch: InstructionSet,
        *,
        metadata_addr: int = metadata.METADATA_ADDR,
        layout: tuple[str, ...] = metadata.FIELDS,
        fallback: bool = True,
        recheck: float = RECHECK,
        clock: Callable[[], float] = time.monotonic,
        kernel_file: ElfImage | None = None,
    ) -> None:
        self.by_cr3 = Cr3Identifier(kernel_modules, programs, arch, kernel_file=kernel_file)
        self.programs = programs
        self.metadata_addr: int | None = metadata_addr
        self.layout = layout
        self.fallback = fallback
        self.arch = arch
        self.recheck = recheck
        self.clock = clock
        self._by_page: Memo[tuple[int, ProcessInfo], Identity] = Memo(_RECENT_LIMIT)
        # CR3 -> (identity, when the metadata page last confirmed it).
        self._recent: Memo[int, tuple[Identity, float]] = Memo(_RECENT_LIMIT)

    @property
    def kernel(self) -> Identity:
        return self.by_cr3.kernel

    async def attach(self, transport: GuestTransport) -> Attached:
        return await self.by_cr3.attach(transport)

    async def housekeep(self) -> None:
        return None

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        """The metadata page, unless this address space was identified a moment ago (or the
        vCPU runs the firmware)."""
        if self.metadata_addr is None or self._fresh(regs.space) is not None:
            return ()
        if self.by_cr3.firmware.runs(regs):
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
        guarded = await self.by_cr3.guard(transport, regs)
        if guarded is not None:
            return guarded
        self.by_cr3.note(regs)
        if self.metadata_addr is not None:
            fresh = self._fresh(regs.space)
            if fresh is not None and (fresh.process is not None or not regs.user):
                return fresh
            found = await self._from_metadata(transport, regs, cache, self.metadata_addr)
            if found is not None:
                return found
        return await self.by_cr3.identify(transport, regs, cache)

    async def _from_metadata(
        self, transport: GuestTransport, regs: Registers, cache: PageCache, addr: int
    ) -> Identity | None:
        size = 8 * len(self.layout)
        await fetch_piece(reader(transport, regs.cpu), cache, addr, size)
        page = cache.read(addr, size)
        info = None if page is None else metadata.parse(page, self.layout)
        if info is None:
            if regs.user:
                if self.fallback:
                    # User code runs without a page: this kernel does not follow the convention.
                    self.metadata_addr = None
                return None
            self._recent.put(regs.space, (self.kernel, self.clock()))
            return self.kernel
        found = self._by_page.get((regs.space, info))
        if found is None:
            found = self._by_page.put(
                (regs.space, info), await self._from_page(transport, regs, info)
            )
        self._recent.put(regs.space, (found, self.clock()))
        return found

    async def _from_page(
        self, transport: GuestTransport, regs: Registers, info: ProcessInfo
    ) -> Identity:
        text = await read_one(reader(transport, regs.cpu), info.text_address, info.text_size)
        image = None if text is None else self.programs.match(text)
        if image is not None:
            bias = info.text_address - image.text_addr
            module = Module.from_image(image, kernel=False, bias=bias)
            process = Process(info.pid, image.name, regs.space)
            return self.by_cr3.with_module(process, module)
        module = await self._unknown_module(transport, regs.cpu, info, text)
        process = Process(info.pid, None, regs.space)
        return self.by_cr3.with_module(process, module)

    async def _unknown_module(
        self, transport: GuestTransport, cpu: int, info: ProcessInfo, text: bytes | None
    ) -> Module:
        """A program no ELF matched: its own ``.eh_frame`` from guest memory, and its code."""
        cfi = None
        if info.has_eh_frame:
            read = reader(transport, cpu)
            data = await read_one(read, info.eh_frame_address, info.eh_frame_size)
            if data is not None:
                cfi = CfiTable.parse(data, info.eh_frame_address)
        end = info.image_base + info.image_size
        mapping = Mapping(UNKNOWN, info.image_base, end, kernel=False)
        return Module.build(mapping, self.arch, cfi=cfi, code=text, code_addr=info.text_address)
