"""qmpprof itself as a benchmarked method: the real sampler (unwinding, process tracking,
symbols) built by ``qmpprof.session`` as the command builds it: the default path (a private
gdbstub opened over QMP), QMP alone, or a gdbstub the VM has; and the first pause of a run."""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

from qmpprof.guest.base import Guest
from qmpprof.session import Connection, Run, RunSpec, attach, connect, load, sampler, start
from qmpprof.transport.base import Reach
from support.bench.methods import Paced


class QmpprofSampler:
    """``qmpprof --kernel K --user-dir U (--qmp-socket S [--transport T] | --gdb A)`` run in
    this process.

    ``setup`` loads the ELF files and connects (the guest keeps running), ``run`` is only the
    sampling, so the guest's progress measured around ``run`` is the sampler's alone.
    """

    def __init__(
        self,
        name: str,
        kernel: Path,
        user_dir: Path | None,
        *,
        qmp: str = "",
        transport: str = "auto",
        gdb: str = "",
    ) -> None:
        """Over the QMP socket ``qmp`` (the default path, or ``transport``), or over the
        gdbstub at ``gdb`` (``qmp`` then says the run state before the stub attaches)."""
        self.name = name
        self._spec = RunSpec(
            reach=Reach(Path(qmp), gdb=gdb or None, transport="gdb" if gdb else transport),
            kernel=kernel,
            user_dir=user_dir,
        )
        self._connection: Connection | None = None
        self._guest: Guest | None = None
        self.path = ""  # how the samples travelled (session.Connection.path)
        self.samples = 0
        self.truncated = 0

    async def setup(self) -> None:
        self._guest = load(self._spec)
        self._connection = await attach(self._guest, await connect(self._spec))
        self.path = self._connection.path
        settle()

    async def run(self, interval: float, duration: float) -> Paced:
        assert self._connection is not None and self._guest is not None
        sampling = dataclasses.replace(self._spec.sampling, interval=interval, duration=duration)
        spec = dataclasses.replace(self._spec, sampling=sampling)
        run = sampler(spec, self._guest, self._connection)
        start = time.perf_counter()
        outcome = await run.run()
        elapsed = time.perf_counter() - start
        stats = run.stats
        self.samples += len(run.profile)
        self.truncated += run.profile.truncated
        details = [f"{kind} x{n}" for kind, n in stats.errors.most_common(3)]
        if not outcome.was_running:
            details.append("the guest was paused: one sample only")
        return Paced(list(stats.pauses), stats.error_count, elapsed, details)

    async def teardown(self) -> None:
        gc.unfreeze()
        if self._connection is not None:
            await self._connection.transport.close()


def settle() -> None:
    """What the qmpprof command does once loaded (cli/sample.py): what was loaded is moved out
    of the collector's sight, so that no full collection walks it inside a pause."""
    gc.collect()
    gc.freeze()


async def sampled(spec: RunSpec) -> Run:
    """One run of ``spec`` as the command makes it (built, loaded files moved out of the
    collector's sight), sampled to its end, its transport closed."""
    run = await start(spec)
    settle()
    try:
        await run.run()
    finally:
        gc.unfreeze()
        await run.transport.close()
    return run


async def first_pause_ms(spec: RunSpec, tries: int) -> list[float]:
    """The first sample's pause of ``tries`` fresh runs, each built as the command builds it
    (ELF files loaded, transport opened) and sampling 5 ticks: what a run pays in its first
    stop with every cache cold."""
    pauses = []
    for _ in range(tries):
        run = await sampled(spec)
        if run.stats.pauses:
            pauses.append(run.stats.pauses[0] * 1e3)
    return pauses
