"""The ways of taking one sample that the benchmark compares, and the paced loop that runs them.

Each method is an object with ``setup``/``sample``/``teardown``; ``sample`` stops the guest, reads
what that method reads and resumes it. The pause it returns is measured from just before the stop
request to just after the resume request was accepted, so every method is timed the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from dataclasses import dataclass, field
from typing import Protocol

from qmpprof.arch.x86regs import X86Formats
from qmpprof.errors import MemoryReadError, QmpprofError, TransportError
from qmpprof.transport import hmp
from qmpprof.transport.gdb import GdbTransport
from support.bench.gdbcli import GdbMi, gdb_batch_backtrace
from support.bench.rawqmp import RawQmp

PAGE = 4096
_U64 = struct.Struct("<Q")


# QEMU serves one client per QMP socket: the raw-socket methods share the benchmark's own
# connection (the one that reads the guest's progress counter) instead of opening theirs.


class Method(Protocol):
    name: str

    async def setup(self) -> None: ...

    async def sample(self) -> float:
        """Take one sample; return the guest pause in seconds."""
        ...

    async def teardown(self) -> None: ...


@dataclass
class Paced:
    """What one paced run of a method achieved."""

    pauses: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0
    details: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return len(self.pauses) / self.elapsed if self.elapsed else 0.0


async def run_paced(method: Method, interval: float, duration: float, *, limit: int = 0) -> Paced:
    """Sample for ``duration`` seconds, letting the guest run ``interval`` after each resume.

    That is how qmpprof's sampler paces itself (the interval is guest run time), so the achieved
    rate of every method is 1 / (interval + pause + what it does between samples).
    """
    out = Paced()
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        if limit and len(out.pauses) + out.errors >= limit:
            break
        await asyncio.sleep(interval)
        try:
            out.pauses.append(await method.sample())
        except QmpprofError as err:
            out.errors += 1
            if len(out.details) < 3:
                out.details.append(str(err))
    out.elapsed = time.perf_counter() - start
    return out


class FloorQmp:
    """(a) The floor: plain-socket QMP stop, ``info registers``, memsave of the RSP page, cont."""

    name = "floor"

    def __init__(self, qmp: RawQmp) -> None:
        self._qmp = qmp

    async def setup(self) -> None:
        return None

    async def sample(self) -> float:
        t0 = time.perf_counter()
        self._qmp.execute("stop")
        try:
            regs = X86Formats().from_monitor(self._qmp.hmp("info registers", cpu=0))[0]
            self._qmp.memsave(regs.sp & ~(PAGE - 1), PAGE, cpu=0)
        finally:
            self._qmp.execute("cont")
        return time.perf_counter() - t0

    async def teardown(self) -> None:
        return None


class EmeraldHmp:
    """(c) An Emerald-style reader: stop, ``info registers``, one HMP ``x/1gx`` per stack word.

    It follows the frame-pointer chain (two words a frame) while RBP points into the stack above
    RSP, then reads words up from RSP until it has read ``words_per_sample`` (16: a return
    address and one saved register for each of 8 frames), so every sample costs the same.
    """

    name = "emerald"

    def __init__(self, qmp: RawQmp, words_per_sample: int = 16, depth: int = 16) -> None:
        self._qmp = qmp
        self._want = words_per_sample
        self._depth = depth
        self.words = 0

    async def setup(self) -> None:
        return None

    def _word(self, addr: int) -> int:
        self.words += 1
        text = self._qmp.hmp(f"x/1gx {addr:#x}", cpu=0)
        value: int = _U64.unpack(hmp.parse_x(text, addr, 8))[0]
        return value

    def _walk(self, rsp: int, rbp: int) -> None:
        read = 0
        while rsp <= rbp < rsp + 16 * PAGE and rbp % 8 == 0 and read < 2 * self._depth:
            self._word(rbp + 8)  # the return address
            rbp = self._word(rbp)  # the caller's frame
            read += 2
        for i in range(self._want - read):
            self._word(rsp + 8 * i)

    async def sample(self) -> float:
        t0 = time.perf_counter()
        self._qmp.execute("stop")
        try:
            regs = X86Formats().from_monitor(self._qmp.hmp("info registers", cpu=0))[0]
            with contextlib.suppress(MemoryReadError):  # the walk ends where the stack does
                self._walk(regs.sp, regs.fp)
        finally:
            self._qmp.execute("cont")
        return time.perf_counter() - t0

    async def teardown(self) -> None:
        return None


class GdbstubLoop:
    """(e) qmpprof's gdbstub transport: stop, ``g``, the RSP page with ``m``, cont. ``fused``
    sends the stop and the register request in one write (``stop_and_registers``)."""

    def __init__(self, gdb_address: str, *, fused: bool = False) -> None:
        self._address = gdb_address
        self._fused = fused
        self.name = "gdbstub-fused" if fused else "gdbstub"
        self._transport: GdbTransport | None = None

    async def setup(self) -> None:
        # The benchmark's guest runs: said, as 8.1 and later stubs do not say it (attaching
        # stops it silently there).
        self._transport = await GdbTransport.connect(self._address, was_running=True)

    async def sample(self) -> float:
        transport = self._transport
        assert transport is not None
        t0 = time.perf_counter()
        if self._fused:
            (regs,) = await transport.stop_and_registers([0])
        else:
            await transport.stop()
        try:
            if not self._fused:
                regs = await transport.registers(0)
            if isinstance(regs, TransportError):
                raise regs
            await transport.read(0, regs.sp & ~(PAGE - 1), PAGE)
        finally:
            await transport.cont()
        return time.perf_counter() - t0

    async def teardown(self) -> None:
        if self._transport is not None:
            await self._transport.close(running=True)


class GdbMiLoop:
    """(d1) One gdb session driven through MI pipes: interrupt, ``bt``, continue per sample."""

    name = "gdb-loop"

    def __init__(self, gdb_address: str, elf: str | None) -> None:
        self._address = gdb_address
        self._elf = elf
        self._gdb: GdbMi | None = None
        self.frames = 0

    async def setup(self) -> None:
        self._gdb = GdbMi(self._elf)
        self._gdb.attach(self._address)

    async def sample(self) -> float:
        assert self._gdb is not None
        t0 = time.perf_counter()
        self.frames += self._gdb.interrupt_backtrace_continue()
        return time.perf_counter() - t0

    async def teardown(self) -> None:
        if self._gdb is not None:
            self._gdb.close()


class GdbBatch:
    """(d2) The poor man's profiler: ``gdb -batch -ex 'target remote' -ex bt`` once per sample.

    The pause is the whole gdb run: gdb reads the ELF before it attaches, so this is an upper
    bound of the pause and exactly the cost per sample.
    """

    name = "gdb-batch"

    def __init__(self, gdb_address: str, elf: str | None) -> None:
        self._address = gdb_address
        self._elf = elf

    async def setup(self) -> None:
        return None

    async def sample(self) -> float:
        t0 = time.perf_counter()
        await asyncio.to_thread(gdb_batch_backtrace, self._address, self._elf)
        return time.perf_counter() - t0

    async def teardown(self) -> None:
        return None
