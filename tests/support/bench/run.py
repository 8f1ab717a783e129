"""``scripts/bench``: boot the bundled guest once and measure every way of sampling it, side by
side: guest pause per sample, achieved rate at two intervals, and how much the guest slowed
down (its progress counter while sampled, in stretches alternating with unsampled ones).
See docs/bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qmpprof.errors import QmpprofError
from qmpprof.sampler import SamplerConfig
from qmpprof.session import RunSpec
from qmpprof.transport.base import Reach
from support.bench import report
from support.bench.guest import Fixture, Guest, boot
from support.bench.intervals import pause_intervals, ratios
from support.bench.isaruns import aarch64_run, riscv64_run
from support.bench.linuxbig import linux_big
from support.bench.linuxchurn import linux_churn
from support.bench.linuxoffcpu import linux_offcpu
from support.bench.linuxrun import linux_run
from support.bench.methods import (
    EmeraldHmp,
    FloorQmp,
    GdbBatch,
    GdbMiLoop,
    GdbstubLoop,
    Method,
    Paced,
    run_paced,
)
from support.bench.offline import offline
from support.bench.qmpprof_run import QmpprofSampler, first_pause_ms
from support.bench.serve_soak import serve_soak
from support.bench.soak import soak
from support.bench.startup import startup

ROOT = Path(__file__).resolve().parents[3]
_SEGMENT = 0.5  # seconds of one sampled (and one unsampled) stretch
METHODS = (
    "floor",
    "qmpprof-default",
    "qmpprof-qmp",
    "emerald",
    "gdb-loop",
    "gdb-batch",
    "gdbstub",
    "gdbstub-fused",
    "qmpprof-gdb",
)
# Methods that drive a gdbstub: opened over the witness QMP socket for them, removed after (the
# guest has none otherwise, so that qmpprof's default path may open its own).
_GDBSTUB = frozenset({"gdb-loop", "gdb-batch", "gdbstub", "gdbstub-fused", "qmpprof-gdb"})
SMP2_METHODS = ("floor", "qmpprof-default", "gdb-loop")
FIRST_PAUSE_TRIES = 5
CHURN_SECONDS = 5.0  # issue 19: a 5 s profile at 10 ms of a guest starting processes


@dataclass
class Run:
    """One method at one interval."""

    method: str
    interval_ms: float
    samples: int
    errors: int
    median_ms: float | None
    p95_ms: float | None
    rate_hz: float
    stopped_fraction: float | None  # of the sampled stretches' wall time, the guest was paused
    progress_per_s: float
    baseline_per_s: float  # unsampled progress, in stretches alternating with the sampled ones
    slowdown: float | None = None  # 1 - progress_per_s / baseline_per_s
    slowdown_se: float | None = None  # its standard error, from the spread between stretches
    notes: list[str] = field(default_factory=list)
    smp: int = 1  # the guest's vCPUs


@dataclass
class Config:
    duration: float = 3.0
    intervals: tuple[float, ...] = (0.010, 0.002)
    batch_samples: int = 8
    variant: str = "cfi"
    methods: tuple[str, ...] = METHODS
    smp2_methods: tuple[str, ...] = SMP2_METHODS  # again on a 2-vCPU guest, at the first interval
    linux: bool = True  # qmpprof on the Linux test guest too


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _progress_around(
    counter: Callable[[], Awaitable[int]], body: Callable[[], Awaitable[Paced]]
) -> tuple[Paced, float]:
    """Run ``body``; return what it achieved and the guest's progress per second meanwhile."""
    c0, t0 = await counter(), time.perf_counter()
    paced = await body()
    c1, t1 = await counter(), time.perf_counter()
    return paced, (c1 - c0) / (t1 - t0)


async def _idle(duration: float) -> Paced:
    await asyncio.sleep(duration)
    return Paced()


@dataclass
class Alternated:
    """The sampled stretches merged, and the guest's progress rate in every stretch."""

    paced: Paced = field(default_factory=Paced)
    sampled: list[float] = field(default_factory=list)  # progress per second, sampled
    idle: list[float] = field(default_factory=list)  # progress per second, left alone

    def slowdown(self) -> tuple[float | None, float | None]:
        """1 - sampled/idle progress, and its standard error (from the spread of stretches)."""
        if not self.idle or statistics.mean(self.idle) <= 0:
            return None, None
        base = statistics.mean(self.idle)
        slowdown = 1 - statistics.mean(self.sampled) / base
        if len(self.idle) < 2:
            return slowdown, None
        var = statistics.variance(self.sampled) + statistics.variance(self.idle)
        return slowdown, (var / len(self.idle)) ** 0.5 / base


async def _alternate(
    counter: Callable[[], Awaitable[int]],
    body: Callable[[float], Awaitable[Paced]],
    segments: int,
    segment: float,
) -> Alternated:
    """Alternate unsampled and sampled stretches (ABAB...), so that drifts in the host's load
    hit both alike; the spread between stretches tells how much the host's load moved."""
    out = Alternated()
    for _ in range(segments):
        for rates, run in ((out.idle, _idle), (out.sampled, body)):
            c0, t0 = await counter(), time.perf_counter()
            paced = await run(segment)
            c1, t1 = await counter(), time.perf_counter()
            rates.append((c1 - c0) / (t1 - t0))
            if rates is out.sampled:
                out.paced.pauses += paced.pauses
                out.paced.errors += paced.errors
                out.paced.elapsed += paced.elapsed
                out.paced.details = (out.paced.details + paced.details)[:3]
    return out


async def baseline(guest: Guest, duration: float) -> float:
    return (await _progress_around(guest.read_progress, functools.partial(_idle, duration)))[1]


def _run(name: str, interval: float, alt: Alternated) -> Run:
    paced = alt.paced
    pauses = [p * 1e3 for p in paced.pauses]
    slowdown, slowdown_se = alt.slowdown()
    return Run(
        method=name,
        interval_ms=interval * 1e3,
        samples=len(pauses),
        errors=paced.errors,
        median_ms=statistics.median(pauses) if pauses else None,
        p95_ms=percentile(pauses, 0.95) if pauses else None,
        rate_hz=paced.rate,
        stopped_fraction=sum(paced.pauses) / paced.elapsed if paced.elapsed else None,
        progress_per_s=statistics.mean(alt.sampled) if alt.sampled else 0.0,
        baseline_per_s=statistics.mean(alt.idle) if alt.idle else 0.0,
        slowdown=slowdown,
        slowdown_se=slowdown_se,
        notes=list(paced.details),
    )


def _methods(name: str, guest: Guest, fixture: Fixture) -> Method | QmpprofSampler:
    kernel = str(fixture.kernel)
    user_dir = fixture.kernel.parent / "user"
    if name == "floor":
        return FloorQmp(guest.witness)
    if name == "emerald":
        return EmeraldHmp(guest.witness)
    if name in ("gdbstub", "gdbstub-fused"):
        return GdbstubLoop(guest.gdb_address, fused=name == "gdbstub-fused")
    if name == "gdb-loop":
        return GdbMiLoop(guest.gdb_address, kernel)
    if name == "gdb-batch":
        return GdbBatch(guest.gdb_address, kernel)
    if name == "qmpprof-default":
        return QmpprofSampler(name, fixture.kernel, user_dir, qmp=guest.qmp_path)
    if name == "qmpprof-qmp":
        return QmpprofSampler(name, fixture.kernel, user_dir, qmp=guest.qmp_path, transport="qmp")
    return QmpprofSampler(name, fixture.kernel, user_dir, qmp=guest.qmp_path, gdb=guest.gdb_address)


async def measure(
    name: str, guest: Guest, fixture: Fixture, cfg: Config, intervals: tuple[float, ...]
) -> list[Run]:
    """Every interval of one method, set up once; setup and teardown are not measured."""
    stub = name in _GDBSTUB
    if stub:
        guest.open_gdbstub()
    method = _methods(name, guest, fixture)
    if name == "gdb-batch":
        intervals = intervals[:1]
    limit = 1 if name == "gdb-batch" else 0  # one gdb run per segment
    runs = []
    try:
        await method.setup()
        for interval in intervals:
            body: Callable[[float], Awaitable[Paced]]
            if isinstance(method, QmpprofSampler):
                body = functools.partial(method.run, interval)
            else:
                body = functools.partial(run_paced, method, interval, limit=limit)
            segments = cfg.batch_samples if limit else max(1, round(cfg.duration / _SEGMENT))
            alternated = await _alternate(guest.read_progress, body, segments, _SEGMENT)
            runs.append(_run(name, interval, alternated))
    finally:
        await method.teardown()
        if stub:
            guest.close_gdbstub()
    words = getattr(method, "words", 0)
    if words and runs:
        runs[0].notes.append(f"{words / max(1, sum(r.samples for r in runs)):.1f} words/sample")
    if isinstance(method, QmpprofSampler) and runs:
        runs[0].notes.append(f"through {method.path}")
    return runs


async def _measure_all(
    methods: tuple[str, ...],
    guest: Guest,
    fixture: Fixture,
    cfg: Config,
    intervals: tuple[float, ...],
    log: Callable[[str], None],
) -> list[Run]:
    runs: list[Run] = []
    for name in methods:
        try:
            done = await measure(name, guest, fixture, cfg, intervals)
        except QmpprofError as err:
            done = [_run(name, intervals[0], Alternated(Paced(errors=1, details=[str(err)])))]
        for run in done:
            run.smp = guest.smp
            log(report.run_line(run.method, asdict(run)))
        runs += done
    return runs


async def _first_pause(guest: Guest, fixture: Fixture, log: Callable[[str], None]) -> list[float]:
    spec = RunSpec(
        reach=Reach(Path(guest.qmp_path)),
        kernel=fixture.kernel,
        user_dir=fixture.kernel.parent / "user",
        sampling=SamplerConfig(interval=0.010, duration=0.05),
    )
    try:
        pauses = await first_pause_ms(spec, FIRST_PAUSE_TRIES)
    except QmpprofError as err:
        log(f"first pause: {err}")
        return []
    log(f"first pause of {len(pauses)} fresh runs (ms): {', '.join(f'{p:.2f}' for p in pauses)}")
    return pauses


async def bench(cfg: Config, log: Callable[[str], None]) -> dict[str, object]:
    fixture = Fixture.find(ROOT, cfg.variant)
    load_start = _load()
    with boot(ROOT, fixture, cfg.variant) as guest:
        await asyncio.sleep(0.5)  # let the workload settle past its start-up
        before = await baseline(guest, cfg.duration)
        log(f"unsampled guest progress: {before:.0f}/s")
        runs = await _measure_all(cfg.methods, guest, fixture, cfg, cfg.intervals, log)
        first = await _first_pause(guest, fixture, log)
        by_interval: dict[str, object] = {}
        if "qmpprof-default" in cfg.methods:  # issue 36: 1 s vs 10 ms, and serve's
            by_interval = await pause_intervals(guest, fixture, log)
        after = await baseline(guest, cfg.duration)
        log(f"unsampled guest progress: {after:.0f}/s (again, at the end)")
    if cfg.smp2_methods:
        with boot(ROOT, fixture, cfg.variant, smp=2) as guest:
            await asyncio.sleep(0.5)
            runs += await _measure_all(
                cfg.smp2_methods, guest, fixture, cfg, cfg.intervals[:1], log
            )
    linux = await linux_run(ROOT, 2 * cfg.duration, log) if cfg.linux else {}
    if cfg.linux:
        linux.update(await linux_churn(ROOT, CHURN_SECONDS, log))
        linux.update(await aarch64_run(2 * cfg.duration, log))
        linux.update(await riscv64_run(ROOT, 2 * cfg.duration, log))
        linux.update(await linux_offcpu(ROOT, cfg.duration, log))
        linux.update(await linux_big(ROOT, cfg.duration, log))
    result: dict[str, object] = {
        "machine": {**report.machine(), "loadavg_start": load_start, "loadavg_end": _load()},
        "config": {
            "duration_s": cfg.duration,
            "intervals_ms": [i * 1e3 for i in cfg.intervals],
            "variant": cfg.variant,
            "kernel": str(fixture.kernel.relative_to(ROOT)),
            "progress_symbol": fixture.progress_symbol,
        },
        "baseline_progress_per_s": [before, after],
        "runs": [asdict(r) for r in runs],
        "first_pause_ms": statistics.median(first) if first else None,
        "first_pauses_ms": first,
    }
    result.update(report.headline(runs, cfg.intervals[0] * 1e3))
    result.update(by_interval)
    result.update(ratios(result))
    result.update(linux)
    result["targets"] = report.targets(result)
    result.update(offline(fixture.kernel, log))
    result.update(startup(ROOT, log))
    return result


def _load() -> list[float]:
    """The host's load average: on a shared 2-core machine the numbers depend on it."""
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON here")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per run (default 3)")
    p.add_argument("--variant", default="cfi", choices=("cfi", "fp"), help="guest build")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument(
        "--smp2-methods",
        default=",".join(SMP2_METHODS),
        help="run again on a 2-vCPU guest at the first interval ('' for none)",
    )
    p.add_argument("--batch-samples", type=int, default=8, help="gdb -batch runs (default 8)")
    p.add_argument(
        "--soak", action="store_true", help="only the memory soak: peak RSS, 3k vs 30k samples"
    )
    p.add_argument("--no-linux", action="store_true", help="skip the Linux test guest's run")
    p.add_argument(
        "--serve-soak",
        metavar="SECONDS",
        type=float,
        nargs="?",
        const=600.0,
        help="only qmpprof serve on four Linux guests of two kernels for SECONDS (default "
        "600): stopped share, truncated, RSS",
    )
    ns = p.parse_args(argv)
    methods = tuple(m for m in ns.methods.split(",") if m)
    smp2 = tuple(m for m in ns.smp2_methods.split(",") if m)
    unknown = sorted(set(methods + smp2) - set(METHODS))
    if unknown:
        p.error(f"unknown method {unknown[0]!r} (known: {', '.join(METHODS)})")
    cfg = Config(
        ns.duration, (0.010, 0.002), ns.batch_samples, ns.variant, methods, smp2, not ns.no_linux
    )

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if ns.serve_soak is not None:
            result = serve_soak(ROOT, ns.serve_soak, log)
        else:
            result = soak(ROOT, log) if ns.soak else asyncio.run(bench(cfg, log))
    except QmpprofError as err:
        print(f"bench: {err}", file=sys.stderr)
        return err.exit_code
    soaked = ns.soak or ns.serve_soak is not None
    print(report.to_json(result) if soaked else report.table(result))
    if ns.json:
        Path(ns.json).write_text(report.to_json(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
