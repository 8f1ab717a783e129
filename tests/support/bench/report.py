"""The benchmark's outputs: the machine it ran on, the headline numbers, a table, JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from typing import Any, Protocol

# JSON key prefix of each method's median pause at the first interval.
PAUSE_KEYS = {
    "floor": "floor_pause_ms",
    "qmpprof-qmp": "qmp_pause_ms",
    "emerald": "emerald_pause_ms",
    "gdb-loop": "gdb_loop_pause_ms",
    "gdb-batch": "gdb_batch_pause_ms",
    "gdbstub": "gdbstub_pause_ms",
    "gdbstub-fused": "gdbstub_fused_pause_ms",
    "qmpprof-gdb": "qmpprof_gdb_pause_ms",
}
# Slowdown at 100 Hz of the two qmpprof runs (and the bare gdbstub loop for reference).
OVERHEAD_KEYS = {
    "qmpprof-qmp": "qmp_overhead_100hz",
    "qmpprof-gdb": "gdbstub_overhead_100hz",
    "floor": "floor_overhead_100hz",
    "gdbstub": "gdbstub_loop_overhead_100hz",
}


class RunLike(Protocol):
    method: str
    interval_ms: float
    median_ms: float | None
    rate_hz: float
    stopped_fraction: float | None
    slowdown: float | None
    slowdown_se: float | None


def machine() -> dict[str, object]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                cpu,
            )
    except OSError:
        pass
    qemu = subprocess.run(
        ["qemu-system-x86_64", "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "qemu": qemu[0] if qemu else "unknown",
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def headline(runs: Sequence[RunLike], interval_ms: float) -> dict[str, Any]:
    """The named numbers at ``interval_ms``: median pauses, 100 Hz slowdowns (with their
    standard errors and the share of time the guest stood stopped), and every run's rate."""
    at = {r.method: r for r in runs if r.interval_ms == interval_ms}
    out: dict[str, Any] = {}
    for method, key in PAUSE_KEYS.items():
        out[key] = at[method].median_ms if method in at else None
    for method, key in OVERHEAD_KEYS.items():
        run = at.get(method)
        out[key] = run.slowdown if run else None
        out[key + "_se"] = run.slowdown_se if run else None
        out[key.replace("overhead", "stopped")] = run.stopped_fraction if run else None
    rates: dict[str, dict[str, float]] = {}
    for r in runs:
        rates.setdefault(r.method, {})[f"{r.interval_ms:g}ms"] = r.rate_hz
    out["rate_hz"] = rates
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run_line(name: str, run: dict[str, Any]) -> str:
    return (
        f"{name:12} {run['interval_ms']:4.0f} ms: {run['samples']:4d} samples,"
        f" {run['errors']} errors, median {_fmt(run['median_ms'], '.3f')} ms,"
        f" p95 {_fmt(run['p95_ms'], '.3f')} ms, {run['rate_hz']:.1f} Hz"
        + "".join(f"; {note}" for note in run["notes"])
    )


def table(result: dict[str, Any]) -> str:
    """One row per method and interval: pauses (also as multiples of the floor's and of the
    gdbstub loop's at the same interval), the share of wall time the guest stood stopped, and
    the guest's slowdown by its progress counter (+- one standard error)."""
    runs: list[dict[str, Any]] = result["runs"]
    floor = {r["interval_ms"]: r["median_ms"] for r in runs if r["method"] == "floor"}
    stub = {r["interval_ms"]: r["median_ms"] for r in runs if r["method"] == "gdbstub"}
    header = (
        f"{'method':12} {'interval':>8} {'samples':>7} {'errors':>6} {'median ms':>9}"
        f" {'p95 ms':>8} {'rate Hz':>8} {'stopped':>7} {'slowdown':>14} {'x floor':>7}"
        f" {'x gdbstub':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        median = r["median_ms"]
        f, s = floor.get(r["interval_ms"]), stub.get(r["interval_ms"])
        slowdown = _fmt(r["slowdown"], ".1%") + " +- " + _fmt(r["slowdown_se"], ".0%")
        lines.append(
            f"{r['method']:12} {r['interval_ms']:6.0f}ms {r['samples']:7d} {r['errors']:6d}"
            f" {_fmt(median, '9.3f')} {_fmt(r['p95_ms'], '8.3f')} {r['rate_hz']:8.1f}"
            f" {_fmt(r['stopped_fraction'], '7.1%')} {slowdown:>14}"
            f" {_fmt(median / f if median and f else None, '7.2f')}"
            f" {_fmt(median / s if median and s else None, '9.2f')}"
        )
    base = result["baseline_progress_per_s"]
    lines.append(f"unsampled guest progress: {base[0]:.0f}/s and {base[1]:.0f}/s")
    elf, offline = result.get("elf_load_ms"), result.get("offline_samples_per_s")
    lines.append(
        f"ELF load: {_fmt(elf, '.1f')} ms; offline unwind+symbolize:"
        f" {_fmt(offline, '.0f')} samples/s"
    )
    linux = result.get("linux_load_ms")
    if isinstance(linux, dict):
        parts = ", ".join(f"{k} {v:.0f}" for k, v in linux.items() if k != "total")
        lines.append(f"Linux image load, cold: {linux['total']:.0f} ms ({parts})")
    return "\n".join(lines)


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, sort_keys=True) + "\n"
