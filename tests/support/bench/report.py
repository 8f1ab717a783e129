"""The benchmark's outputs: the machine it ran on, the headline numbers, a table, JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from typing import Any, Protocol

# JSON key of each method's median pause at the first interval.
PAUSE_KEYS = {
    "floor": "floor_pause_ms",
    "qmpprof-default": "default_pause_ms",
    "qmpprof-qmp": "qmp_pause_ms",
    "emerald": "emerald_pause_ms",
    "gdb-loop": "gdb_loop_pause_ms",
    "gdb-batch": "gdb_batch_pause_ms",
    "gdbstub": "gdbstub_pause_ms",
    "gdbstub-fused": "gdbstub_fused_pause_ms",
    "qmpprof-gdb": "qmpprof_gdb_pause_ms",
}
# Slowdown at 100 Hz: qmpprof's three paths, the QMP floor and the bare gdbstub loop (issue 12
# names it gdbstub_overhead_100hz; gdbstub_loop_overhead_100hz is the same number, kept).
OVERHEAD_KEYS = (
    ("qmpprof-default", "default_overhead_100hz"),
    ("qmpprof-qmp", "qmp_overhead_100hz"),
    ("qmpprof-gdb", "qmpprof_gdb_overhead_100hz"),
    ("floor", "floor_overhead_100hz"),
    ("gdbstub", "gdbstub_overhead_100hz"),
    ("gdbstub", "gdbstub_loop_overhead_100hz"),
)
# Issue 12's targets: (name, numerator key, denominator key, the most the ratio may be).
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("default vs floor", "default_pause_ms", "floor_pause_ms", 0.45),
    ("default vs gdb in a loop", "default_pause_ms", "gdb_loop_pause_ms", 0.67),
    ("default vs bare gdbstub slowdown", "default_overhead_100hz", "gdbstub_overhead_100hz", 1.15),
    ("default, 2 vCPUs vs 1", "default_pause_ms_smp2", "default_pause_ms", 1.5),
    ("first pause vs default", "first_pause_ms", "default_pause_ms", 2.0),
    # Both on 2 vCPUs, sampled in turn in the same minutes (linuxrun.py).
    ("Linux sample vs bundled guest (2 vCPUs)", "linux_pause_ms", "linux_reference_pause_ms", 1.3),
)
# Issue 19's targets on a guest starting processes all the time (linuxchurn.py): (name, key,
# the least the value may be, the most).
BOUNDS: tuple[tuple[str, str, float | None, float | None], ...] = (
    ("Linux churn: rate in run time vs asked", "linux_churn_rate_share", 0.95, None),
    ("Linux churn: wall vs run time asked + pauses", "linux_churn_wall_ratio", None, 1.2),
    # Issue 21's (linuxoffcpu.py): a pause with --off-cpu vs without, 200+ tasks.
    ("Linux pause with --off-cpu vs without", "offcpu_pause_ratio", None, 1.5),
    # Issue 38's (linuxbig.py): p95 pause with 65,530 mappings and 30,000 functions vs without.
    ("Linux p95 pause, big guest vs plain", "big_guest_pause_ratio", None, 2.0),
    # Issue 36's (intervals.py): a sample's cost at every rate.
    ("pause at a 1 s interval vs 10 ms", "pause_interval_ratio", None, 1.5),
    ("serve's pause vs the command's at 10 ms", "serve_pause_ratio", None, 1.5),
    ("default pause vs the bare gdbstub loop's", "default_pause_ratio", None, 1.1),
    ("a run's first pause vs the default's median", "first_pause_ratio", None, 2.0),
    ("Linux sample vs bundled guest, alternated (issue 36)", "linux_pause_ratio", None, 1.2),
    ("aarch64 --off-cpu: rate in run time vs asked", "aarch64_offcpu_rate_share", 0.9, None),
    # Issue 33's (isaruns.py): a riscv64 Linux guest's sample vs the x86_64 Linux guest's.
    ("riscv64 Linux sample vs x86_64's, alternated", "riscv64_pause_ratio", None, 1.5),
)


class RunLike(Protocol):
    method: str
    interval_ms: float
    median_ms: float | None
    rate_hz: float
    stopped_fraction: float | None
    slowdown: float | None
    slowdown_se: float | None
    smp: int


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
    standard errors and the share of time the guest stood stopped), and every run's rate. Runs
    on a 2-vCPU guest give the same keys with ``_smp2`` appended (where they were measured)."""
    out: dict[str, Any] = {}
    for smp, suffix in ((1, ""), (2, "_smp2")):
        at = {r.method: r for r in runs if r.interval_ms == interval_ms and r.smp == smp}
        if smp > 1 and not at:
            continue
        for method, key in PAUSE_KEYS.items():
            if smp == 1 or method in at:
                out[key + suffix] = at[method].median_ms if method in at else None
        for method, key in OVERHEAD_KEYS:
            run = at.get(method)
            if smp > 1 and run is None:
                continue
            out[key + suffix] = run.slowdown if run else None
            out[key + "_se" + suffix] = run.slowdown_se if run else None
            out[key.replace("overhead", "stopped") + suffix] = run.stopped_fraction if run else None
    rates: dict[str, dict[str, float]] = {}
    for r in runs:
        name = r.method if r.smp == 1 else f"{r.method}_smp{r.smp}"
        rates.setdefault(name, {})[f"{r.interval_ms:g}ms"] = r.rate_hz
    out["rate_hz"] = rates
    return out


def targets(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target's ratio within this run, its limit (``least`` for a floor), and whether it
    was met (None: a number is missing)."""
    out: dict[str, dict[str, Any]] = {}
    for name, top, bottom, limit in TARGETS:
        a, b = result.get(top), result.get(bottom)
        ratio = a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None
        met = None if ratio is None else ratio <= limit
        out[name] = {"ratio": ratio, "limit": limit, "met": met}
    for name, key, least, most in BOUNDS:
        value = result.get(key)
        value = value if isinstance(value, float) else None
        met = None
        if value is not None:
            met = (least is None or value >= least) and (most is None or value <= most)
        out[name] = {"ratio": value, "limit": most, "least": least, "met": met}
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

    def where(r: dict[str, Any]) -> tuple[float, int]:
        return r["interval_ms"], r.get("smp", 1)

    floor = {where(r): r["median_ms"] for r in runs if r["method"] == "floor"}
    stub = {where(r): r["median_ms"] for r in runs if r["method"] == "gdbstub"}
    header = (
        f"{'method':20} {'interval':>8} {'samples':>7} {'errors':>6} {'median ms':>9}"
        f" {'p95 ms':>8} {'rate Hz':>8} {'stopped':>7} {'slowdown':>14} {'x floor':>7}"
        f" {'x gdbstub':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        median = r["median_ms"]
        f, s = floor.get(where(r)), stub.get(where(r))
        name = r["method"] + (f" ({r['smp']} vCPUs)" if r.get("smp", 1) > 1 else "")
        slowdown = _fmt(r["slowdown"], ".1%") + " +- " + _fmt(r["slowdown_se"], ".0%")
        lines.append(
            f"{name:20} {r['interval_ms']:6.0f}ms {r['samples']:7d} {r['errors']:6d}"
            f" {_fmt(median, '9.3f')} {_fmt(r['p95_ms'], '8.3f')} {r['rate_hz']:8.1f}"
            f" {_fmt(r['stopped_fraction'], '7.1%')} {slowdown:>14}"
            f" {_fmt(median / f if median and f else None, '7.2f')}"
            f" {_fmt(median / s if median and s else None, '9.2f')}"
        )
    first = result.get("first_pause_ms")
    lines.append(f"first pause of a run (median of fresh runs): {_fmt(first, '.3f')} ms")
    for name, target in result.get("targets", {}).items():
        met = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
        bound = (
            f"at least {target['least']}x"
            if target.get("least") is not None
            else f"at most {target['limit']}x"
        )
        lines.append(f"target {name}: {_fmt(target['ratio'], '.2f')}x ({bound}): {met}")
    base = result["baseline_progress_per_s"]
    lines.append(f"unsampled guest progress: {base[0]:.0f}/s and {base[1]:.0f}/s")
    elf, offline = result.get("elf_load_ms"), result.get("offline_samples_per_s")
    lines.append(
        f"ELF load: {_fmt(elf, '.1f')} ms; offline unwind+symbolize:"
        f" {_fmt(offline, '.0f')} samples/s"
    )
    for key, how in (("linux_load_ms", "cold"), ("linux_load_cached_ms", "cached")):
        linux = result.get(key)
        if isinstance(linux, dict):
            parts = ", ".join(f"{k} {v:.0f}" for k, v in linux.items() if k != "total")
            lines.append(f"Linux image load, {how}: {linux['total']:.0f} ms ({parts})")
    return "\n".join(lines)


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, sort_keys=True) + "\n"
