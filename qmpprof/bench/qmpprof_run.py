"""qmpprof itself as a benchmarked method: the real sampler (unwinding, process tracking,
symbols) built the way the ``qmpprof`` command builds it, over QMP or over the gdbstub."""

from __future__ import annotations

import time
from pathlib import Path

from qmpprof.bench.methods import Paced
from qmpprof.cli.options import parse
from qmpprof.cli.profile import build_symbolizer, connect
from qmpprof.sampler import Sampler, SamplerConfig, Symbolizer
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.chain import AddressSpace, Unwinder

_WINDOW = 16384  # what the command reads at RSP over QMP memsave and over the gdbstub


class QmpprofSampler:
    """``qmpprof --kernel K --user-dir U (--qmp-socket S | --gdb A)`` run in this process.

    ``setup`` loads the ELF files and connects (the guest keeps running), ``run`` is only the
    sampling, so the guest's progress measured around ``run`` is the sampler's alone.
    """

    def __init__(self, name: str, kernel: Path, user_dir: Path | None, target: list[str]) -> None:
        self.name = name
        self._argv = ["--kernel", str(kernel), *target]
        if user_dir is not None:
            self._argv += ["--user-dir", str(user_dir)]
        self._transport: GuestTransport | None = None
        self._symbolizer: Symbolizer[AddressSpace] | None = None
        self.samples = 0
        self.truncated = 0

    async def setup(self) -> None:
        opts = parse(self._argv)
        self._symbolizer = build_symbolizer(opts)
        self._transport = await connect(opts)
        self._boundary = opts.kernel_boundary

    async def run(self, interval: float, duration: float) -> Paced:
        assert self._transport is not None and self._symbolizer is not None
        config = SamplerConfig(interval=interval, duration=duration, window=_WINDOW)
        sampler = Sampler(
            self._transport, Unwinder(kernel_boundary=self._boundary), self._symbolizer, config
        )
        start = time.perf_counter()
        outcome = await sampler.run()
        elapsed = time.perf_counter() - start
        stats = sampler.stats
        self.samples += stats.samples
        self.truncated += stats.truncated
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
