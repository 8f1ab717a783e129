"""qmpprof on the test guests of the other instruction sets, as ``qmpprof --qmp-socket S
--kernel K`` runs them, at 10 ms on 2 vCPUs: the median pause of a sample, its first pause and
its truncated share, keys named by the instruction set (``aarch64_pause_ms``,
``riscv64_pause_ms``, beside the x86_64 Linux guest's ``linux_pause_ms``).

- aarch64: tests/aarch64vm.py, bookworm's arm64 6.1 under qemu-system-aarch64, KASLR on,
  ``-cpu max``.
- riscv64: tests/riscv64vm.py, trixie's riscv64 6.12 under qemu-system-riscv64 (OpenSBI), its
  -dbg vmlinux, the xz workload; sampled in turn with the x86_64 Linux guest (tests/linuxvm.py),
  so that the two pauses compare within one stretch of the host's time."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from qmpprof.errors import QmpprofError
from qmpprof.sampler import SamplerConfig
from qmpprof.session import RunSpec
from qmpprof.transport.base import Reach
from support.bench.linuxrun import STRETCH, alternate
from support.bench.qmpprof_run import sampled

INTERVAL = 0.010


class Booted(Protocol):
    qmp_socket: Path


async def aarch64_run(duration: float, log: Callable[[str], None]) -> dict[str, object]:
    """``duration`` seconds of guest run time sampled on the aarch64 guest."""
    try:
        from aarch64vm import image, running_aarch64_guest
    except ImportError as err:
        return _unmeasured("aarch64", f"{err}", log)
    return await _run(
        "aarch64",
        lambda tmp: running_aarch64_guest(tmp, "6.1", dump_kallsyms=False),
        lambda: image("6.1"),
        duration,
        log,
        off_cpu=True,
    )


async def riscv64_run(root: Path, duration: float, log: Callable[[str], None]) -> dict[str, object]:
    """``duration`` seconds of guest run time sampled on the riscv64 guest, in stretches
    alternated with the x86_64 Linux guest's (linuxrun.py's), both on 2 vCPUs with their user
    programs given: ``riscv64_pause_ratio``, the riscv64 median pause over the x86_64 one in
    the same stretches (issue 33: at most 1.5), immune to the host's speed drifting between
    two runs."""
    try:
        from linuxvm import ROOTFS as LINUX_ROOTFS
        from linuxvm import running_linux_guest
        from riscv64vm import ROOTFS, running_riscv64_guest, vmlinux_dbg
    except ImportError as err:
        return _unmeasured("riscv64", f"{err}", log)
    sampling = SamplerConfig(interval=INTERVAL, duration=STRETCH)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with (
                running_riscv64_guest(Path(tmp)) as riscv64,
                running_linux_guest(Path(tmp), kaslr=True, smp=2, dump_kallsyms=False) as x86,
            ):
                specs = (
                    RunSpec(
                        reach=Reach(riscv64.qmp_socket),
                        kernel=vmlinux_dbg(),
                        user_dir=ROOTFS,
                        sampling=sampling,
                    ),
                    RunSpec(
                        reach=Reach(x86.qmp_socket),
                        kernel=root / "fixtures" / "build" / "linux" / "vmlinuz",
                        user_dir=LINUX_ROOTFS,
                        sampling=sampling,
                    ),
                )
                pauses, truncated, samples = await alternate(specs, duration)
        except (QmpprofError, RuntimeError, TimeoutError) as err:
            return _unmeasured("riscv64", f"{err}", log)
    ms, x86_ms = ([p * 1e3 for p in run] for run in pauses)
    median, x86_median = statistics.median(ms), statistics.median(x86_ms)
    log(
        f"riscv64: {samples} samples, {truncated} truncated, median pause {median:.3f} ms,"
        f" first {ms[0]:.3f} ms; the x86_64 Linux guest in the same stretches: median"
        f" {x86_median:.3f} ms"
    )
    return {
        "riscv64_pause_ms": median,
        "riscv64_first_pause_ms": ms[0],
        "riscv64_truncated_share": truncated / samples if samples else None,
        "riscv64_samples": samples,
        "riscv64_linux_pause_ms": x86_median,
        "riscv64_pause_ratio": round(median / x86_median, 3) if x86_median > 0 else None,
    }


def _unmeasured(name: str, why: str, log: Callable[[str], None]) -> dict[str, object]:
    log(f"{name} run: {why}: not measured")
    return {f"{name}_pause_ms": None, f"{name}_first_pause_ms": None}


async def _run(
    name: str,
    boot: Callable[[Path], contextlib.AbstractContextManager[Booted]],
    kernel: Callable[[], Path],
    duration: float,
    log: Callable[[str], None],
    user_dir: Path | None = None,
    *,
    off_cpu: bool = False,
) -> dict[str, object]:
    """The run as the command makes it; with ``off_cpu``, a second one with ``--off-cpu`` on
    the same guest after it: ``{name}_offcpu_rate_share``, its ticks per second of guest run
    time over the rate asked (issue 36: at least 0.9)."""
    sampling = SamplerConfig(interval=INTERVAL, duration=duration)
    found: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with boot(Path(tmp)) as guest:
                spec = RunSpec(
                    reach=Reach(guest.qmp_socket),
                    kernel=kernel(),
                    sampling=sampling,
                    user_dir=user_dir,
                )
                run = await sampled(spec)
                if off_cpu:
                    offcpu = await sampled(dataclasses.replace(spec, off_cpu=True))
                    stats = offcpu.stats
                    found[f"{name}_offcpu_rate_share"] = round(
                        stats.rate_hz() / stats.requested_hz, 3
                    )
                    log(
                        f"{name} --off-cpu: {stats.rate_hz():.1f} Hz of guest run time"
                        f" ({stats.requested_hz:.0f} asked; {stats.wall_rate_hz():.1f} Hz of"
                        f" wall time), median pause {statistics.median(stats.pauses) * 1e3:.2f}"
                        f" ms, {len(offcpu.profile)} samples on and off CPU in {stats.ticks} ticks"
                    )
        except (QmpprofError, RuntimeError, TimeoutError) as err:
            return _unmeasured(name, f"{err}", log)
    ms = [p * 1e3 for p in run.stats.pauses]
    samples = len(run.profile)
    median = statistics.median(ms) if ms else None
    log(
        f"{name}: {samples} samples, {run.profile.truncated} truncated, median pause"
        f" {median} ms, first {ms[0] if ms else None} ms"
    )
    return found | {
        f"{name}_pause_ms": median,
        f"{name}_first_pause_ms": ms[0] if ms else None,
        f"{name}_truncated_share": run.profile.truncated / samples if samples else None,
        f"{name}_samples": samples,
    }
