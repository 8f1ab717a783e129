"""A scripted fake GuestTransport, a virtual clock, and a frame-pointer unwinder for unit tests.

The fake transport keeps guest memory as pages, records every call, advances the virtual clock
by a cost per call (so pause and timing policy are checked by counting, never by sleeping), and
runs an optional hook before each call (to raise GuestGoneError on the n-th stop, for example).
"""

from __future__ import annotations

import bisect
import re
import struct
import zlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from qmpprof.arch.x86 import X86_64
from qmpprof.arch.x86regs import x86_registers
from qmpprof.dwarf.cfi import CfiTable
from qmpprof.elf.symbols import SymbolTable
from qmpprof.errors import MemoryReadError, TransportError
from qmpprof.memory import Reader
from qmpprof.model import (
    Frame,
    Mapping,
    Mode,
    Process,
    Registers,
    Sample,
    Stack,
    StopReason,
)
from qmpprof.pagecache import PAGE, PageCache, page_of
from qmpprof.profile import Profile
from qmpprof.transport.base import GuestTransport, each_registers
from qmpprof.unwind.space import Module

KERNEL_BOUNDARY = X86_64.kernel_boundary


@dataclass
class FakeClock:
    now: float = 0.0
    sleeps: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeTransport:
    """Registers per vCPU (fixed, or a function of the tick number) and paged memory."""

    def __init__(
        self,
        regs: dict[int, Registers] | Callable[[int, int], Registers],
        memory: dict[int, bytes] | None = None,
        *,
        clock: FakeClock | None = None,
        running: bool = True,
        costs: dict[str, float] | None = None,
        hook: Callable[[str, int], None] | None = None,
        partial: bool = False,
    ) -> None:
        """``partial``: a failed read says how far it got, as the gdbstub does."""
        self._regs = regs
        self.partial = partial
        self.pages: dict[int, bytes] = dict(memory or {})
        self.clock = clock or FakeClock()
        self.running = running
        self.costs = costs or {}
        self.hook = hook
        self.calls: list[str] = []
        self.stops = 0
        self.closed = False
        self.physical: dict[int, bytes] = {}  # guest-physical pages
        self.linear_offset: int | None = None  # translate(): virtual - physical, when set

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.hook is not None:
            self.hook(name, self.stops)
        self.clock.now += self.costs.get(name.split(":")[0], 0.0)

    async def is_running(self) -> bool:
        self._call("is_running")
        return self.running

    async def stop(self) -> None:
        self._call("stop")
        self.stops += 1
        self.running = False

    async def cont(self) -> None:
        self._call("cont")
        self.running = True

    async def cpus(self) -> list[int]:
        self._call("cpus")
        if isinstance(self._regs, dict):
            return sorted(self._regs)
        return [0]

    async def registers(self, cpu: int) -> Registers:
        self._call(f"registers:{cpu}")
        if isinstance(self._regs, dict):
            return self._regs[cpu]
        return self._regs(cpu, self.stops)

    async def stop_and_registers(self, cpus: Sequence[int]) -> list[Registers | TransportError]:
        await self.stop()
        return await each_registers(self, cpus)

    async def read(self, cpu: int, addr: int, size: int) -> bytes:
        self._call(f"read:{addr:#x}+{size:#x}")
        out = bytearray()
        start = addr - page_of(addr)
        for page in range(page_of(addr), addr + size, PAGE):
            if page not in self.pages:
                readable = bytes(out[start:]) if self.partial else None
                raise MemoryReadError(addr, size, "not mapped", readable)
            out += self.pages[page]
        return bytes(out[start : start + size])

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        return await read_each(self.read, cpu, ranges)

    async def read_physical(
        self, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        self._call("read_physical")
        out: list[bytes | MemoryReadError] = []
        for addr, size in ranges:
            page = self.physical.get(page_of(addr))
            start = addr - page_of(addr)
            if page is None or start + size > PAGE:
                out.append(MemoryReadError(addr, size, "not in RAM"))
            else:
                out.append(page[start : start + size])
        return out

    async def translate(self, cpu: int, addr: int) -> int | None:
        self._call(f"translate:{cpu}")
        offset = self.linear_offset
        return None if offset is None or self._regs_of(cpu).user else addr - offset

    def _regs_of(self, cpu: int) -> Registers:
        return self._regs[cpu] if isinstance(self._regs, dict) else self._regs(cpu, self.stops)

    @property
    def control(self) -> FakeTransport:
        """Itself: reads need no stop here."""
        return self

    async def close(self) -> None:
        self.closed = True


async def read_each(
    read: Callable[[int, int, int], Awaitable[bytes]], cpu: int, ranges: Sequence[tuple[int, int]]
) -> list[bytes | MemoryReadError]:
    """A fake transport's read_many: each range read alone, an unmapped one as its error."""
    out: list[bytes | MemoryReadError] = []
    for addr, size in ranges:
        try:
            out.append(await read(cpu, addr, size))
        except MemoryReadError as err:
            out.append(err)
    return out


def regs(cpu: int, rip: int, rsp: int = 0, rbp: int = 0, cpl: int | None = None) -> Registers:
    """Registers with CPL following the kernel boundary unless given."""
    if cpl is None:
        cpl = 0 if rip >= KERNEL_BOUNDARY else 3
    return x86(cpu, rip, rsp, rbp, cpl=cpl)


def x86(
    cpu: int = 0,
    rip: int = 0,
    rsp: int = 0,
    rbp: int = 0,
    *,
    cpl: int = 0,
    cr3: int = 0x1000,
    gprs: dict[str, int] | None = None,
    long_mode: bool = True,
    gs_base: int = 0,
    cr0: int | None = None,
) -> Registers:
    """An x86 vCPU's registers as QEMU's would read (x86_64's in long mode, i386's outside);
    without ``cr0`` they do not say whether it pages."""
    named = {**(gprs or {}), "rip": rip, "rsp": rsp, "rbp": rbp}
    return x86_registers(
        cpu, named, cpl=cpl, cr3=cr3, long_mode=long_mode, gs_base=gs_base, cr0=cr0
    )


def frame_chain(
    stack_top: int, returns: Iterable[int], gap: int = 0
) -> tuple[int, dict[int, bytes]]:
    """Lay out a frame-pointer chain growing down from ``stack_top``.

    Returns (rbp of the leaf, pages). Each frame is ``gap`` bytes of locals then
    [saved rbp][return address]; the outermost saved rbp is 0.
    """
    mem: dict[int, int] = {}
    rbp = 0
    pos = stack_top
    for ret in reversed(list(returns)):
        pos -= 16 + gap
        mem[pos], mem[pos + 8] = rbp, ret
        rbp = pos
    lo, hi = page_of(pos), page_of(stack_top - 1) + PAGE
    image = bytearray(hi - lo)
    for addr, value in mem.items():
        struct.pack_into("<Q", image, addr - lo, value)
    return rbp, {p: bytes(image[p - lo : p - lo + PAGE]) for p in range(lo, hi, PAGE)}


@dataclass(frozen=True)
class FakeSpace:
    """Symbols as sorted (start, end, name) ranges."""

    symbols: tuple[tuple[int, int, str], ...] = ()

    def name(self, pc: int) -> tuple[str | None, int]:
        starts = [s for s, _, _ in self.symbols]
        i = bisect.bisect_right(starts, pc) - 1
        if i >= 0 and pc < self.symbols[i][1]:
            return self.symbols[i][2], pc - self.symbols[i][0]
        return None, 0


RawStack = tuple[tuple[int, ...], StopReason]


class FramePointerUnwinder:
    """The leaf's RIP, then [rbp+8] return addresses along the saved-rbp chain."""

    kernel_boundary = KERNEL_BOUNDARY

    def __init__(self, max_depth: int = 64, on_resolve: Callable[[], None] | None = None) -> None:
        self.max_depth = max_depth
        self.on_resolve = on_resolve
        self.unwinds = 0

    def unwind(self, regs: Registers, cache: PageCache, space: FakeSpace) -> RawStack:
        self.unwinds += 1
        pcs = [regs.pc]
        rbp = regs.fp
        while rbp != 0:
            if len(pcs) >= self.max_depth:
                return tuple(pcs), StopReason.DEPTH
            saved, ret = cache.read_u64(rbp), cache.read_u64(rbp + 8)
            if saved is None or ret is None:
                return tuple(pcs), StopReason.READ_FAILED
            pcs.append(ret)
            rbp = saved
        return tuple(pcs), StopReason.END

    def unplaced(self, raw: RawStack, space: FakeSpace) -> tuple[int, ...]:
        """The user pcs no symbol of ``space`` covers."""
        return tuple(pc for pc in raw[0] if pc < KERNEL_BOUNDARY and space.name(pc)[0] is None)

    def resolve(self, raw: RawStack, space: FakeSpace) -> Stack:
        if self.on_resolve is not None:
            self.on_resolve()
        frames = []
        for pc in raw[0]:
            symbol, offset = space.name(pc)
            frames.append(Frame(pc, pc >= KERNEL_BOUNDARY, symbol, offset))
        return Stack(tuple(frames), raw[1])


Space = TypeVar("Space")


@dataclass(frozen=True, slots=True)
class KernelIdentity(Generic[Space]):
    """Every sample belongs to the kernel, in one address space."""

    process: Process | None
    space: Space
    memory: Reader | None = None  # as the vCPU sees it
    registers: Registers | None = None  # as sampled
    reread_mappings: None = None  # its space is never read again
    complete: None = None  # nor its files


class KernelIdentifier(Generic[Space]):
    """A GuestIdentifier with no processes: every sample is unwound and named in one space."""

    def __init__(self, space: Space) -> None:
        self._identity = KernelIdentity(None, space)

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        return ()

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> KernelIdentity[Space]:
        return self._identity


def named_sample(
    names: Sequence[str], time: float = 0.0, cpu: int = 0, kernel: Sequence[bool] | None = None
) -> Sample:
    """A sample whose frames render as ``names`` (root first) in the default naming.

    ``names[0]`` is the context: ``kernel``, ``PROGRAM (pid N)`` or ``cr3=0x...``; a
    ``[truncated]`` right after it marks a walk that stopped early. A frame is kernel code when
    ``kernel`` says so, else when its name ends in ``_[k]`` (the suffix is then the naming's)."""
    root, *rest = names
    stop = StopReason.END
    flags = list(kernel) if kernel is not None else [n.endswith("_[k]") for n in names]
    if rest and rest[0] == "[truncated]":
        rest, flags, stop = rest[1:], [flags[0], *flags[2:]], StopReason.DEPTH
    frames = tuple(
        Frame(zlib.crc32(name.encode()), is_kernel, name.removesuffix("_[k]"))
        for name, is_kernel in zip(reversed(rest), reversed(flags[1:]), strict=True)
    )
    process = _process(root)
    mode = Mode.KERNEL if frames and frames[0].kernel else Mode.USER
    return Sample(time, cpu, mode, mode is Mode.USER, 0, Stack(frames, stop), process)


def _process(root: str) -> Process | None:
    if root == "kernel":
        return None
    found = re.fullmatch(r"(.+) \(pid (\d+)\)", root)
    if found:
        return Process(int(found[2]), found[1], 0)
    if root.startswith("cr3="):
        return Process(None, None, int(root[4:], 16), space_name="cr3")
    raise ValueError(f"not a context name: {root!r}")


def profile_of(stacks: Iterable[Sequence[str]], interval_ms: float = 10.0) -> Profile:
    """A profile with one sample per name tuple, 10 ms apart on vCPU 0."""
    profile = Profile(interval_ms)
    for i, names in enumerate(stacks):
        profile.add(named_sample(names, i * interval_ms / 1000))
    return profile


def make_module(
    name: str,
    start: int,
    end: int,
    kernel: bool,
    *,
    bias: int = 0,
    symbols: SymbolTable | None = None,
    cfi: CfiTable | None = None,
    code: bytes | None = None,
    code_addr: int = 0,
    starts: Callable[[], Sequence[int]] | None = None,
) -> Module:
    """A Module from its parts, with the unwinding steps they allow."""
    mapping = Mapping(name, start, end, kernel, bias)
    return Module.build(
        mapping, X86_64, cfi=cfi, code=code, code_addr=code_addr, symbols=symbols, starts=starts
    )
