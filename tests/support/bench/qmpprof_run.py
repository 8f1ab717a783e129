"""qmpprof itself as a benchmarked method: the real sampler (unwinding, process tracking,
symbols) built by ``qmpprof.session`` as the command builds it, over QMP or the gdbstub."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from qmpprof.guest.base import GuestIdentifier
from qmpprof.sampler import Sampler
from qmpprof.session import RunSpec, build_identifier, connect, sampler_config, unwinder
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.chain import AddressSpace
from support.bench.methods import Paced


class QmpprofSampler:
    """``qmpprof --kernel K --user-dir U (--qmp-socket S | --gdb A)`` run in this process.

    ``setup`` loads the ELF files and connects (the guest keeps running), ``run`` is only the
    sampling, so the guest's progress measured around ``run`` is the sampler's alone.
    """

    def __init__(
        self, name: str, kernel: Path, user_dir: Path | None, *, qmp: str = "", gdb: str = ""
    ) -> None:
        """Over the QMP socket ``qmp``, else over the gdbstub at ``gdb``."""
        self.name = name
        if qmp:
            self._spec = RunSpec(qmp_socket=Path(qmp), kernel=kernel, user_dir=user_dir)
        else:
            self._spec = RunSpec(transport="gdb", gdb=gdb, kernel=kernel, user_dir=user_dir)
        self._transport: GuestTransport | None = None
        self._identifier: GuestIdentifier[AddressSpace] | None = None
        self.samples = 0
        self.truncated = 0

    async def setup(self) -> None:
        self._identifier = build_identifier(self._spec)
        self._transport = (await connect(self._spec)).transport

    async def run(self, interval: float, duration: float) -> Paced:
        assert self._transport is not None and self._identifier is not None
        config = dataclasses.replace(
            sampler_config(self._spec, self._transport), interval=interval, duration=duration
        )
        sampler = Sampler(self._transport, unwinder(self._spec), self._identifier, config)
        start = time.perf_counter()
        outcome = await sampler.run()
        elapsed = time.perf_counter() - start
        stats = sampler.stats
        self.samples += len(sampler.profile)
        self.truncated += sampler.profile.truncated
        details = [f"{kind} x{n}" for kind, n in stats.errors.most_common(3)]
        if not outcome.was_running:
            details.append("the guest was paused: one sample only")
        return Paced(list(stats.pauses), stats.error_count, elapsed, details)

    async def read_u64(self, addr: int) -> int:
        """A guest word through this sampler's own transport (its QMP connection is the only
        one QEMU serves while it is open)."""
        assert self._transport is not None
        return int.from_bytes(await self._transport.read(0, addr, 8), "little")

    async def teardown(self) -> None:
        if self._transport is not None:
            await self._transport.close()
