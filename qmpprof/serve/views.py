"""What serve shows about its VMs, as text: the index page (HTML) and the Prometheus metrics
(text exposition format 0.0.4). Read from the HTTP threads: each VM's numbers are copied once."""

from __future__ import annotations

import html
import urllib.parse
from collections.abc import Sequence

from qmpprof.serve.vm import LIVE, PAUSE_BUCKETS, Vm

DEFAULT_SECONDS = 30  # what the links ask for (Go's default for /debug/pprof/profile)


def index(vms: Sequence[Vm], window: int) -> str:
    rows = "\n".join(_row(vm, min(DEFAULT_SECONDS, window)) for vm in vms)
    if not vms:
        rows = '<tr><td colspan="10">no VM yet</td></tr>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>qmpprof serve</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ border-bottom: 1px solid #ccc; padding: 0.3em 0.8em; text-align: right; }}
th:first-child, td:first-child, td.links {{ text-align: left; }}
.down, .paused {{ color: #b00; }}
</style></head>
<body>
<h1>qmpprof serve</h1>
<p>Profiles of the last {window} s are kept; live numbers cover the last {LIVE} s.
<a href="/metrics">metrics</a></p>
<table id="vms">
<tr><th>VM</th><th>state</th><th>rate (Hz)</th><th>interval (ms)</th>
<th>median pause (ms)</th><th>errors</th><th>truncated</th><th>guest stopped</th>
<th>budget</th><th>profiles</th></tr>
{rows}
</table>
</body></html>
"""


def _row(vm: Vm, seconds: int) -> str:
    live = vm.live()
    name = html.escape(vm.name)
    query = html.escape(urllib.parse.urlencode({"vm": vm.name, "seconds": seconds}))
    state = html.escape(vm.state)
    if vm.problem:
        state = f'<span title="{html.escape(vm.problem)}">{state}</span>'
    return (
        f'<tr class="vm"><td>{name}</td><td class="{html.escape(vm.state)}">{state}</td>'
        f"<td>{live.rate_hz:.1f}</td><td>{vm.interval * 1e3:.0f}</td>"
        f"<td>{live.median_pause_ms:.2f}</td>"
        f"<td>{vm.errors_total}</td><td>{vm.truncated_total}</td>"
        f'<td class="stopped">{live.stopped:.2%}</td>'
        f"<td>{'none' if vm.budget is None else f'{vm.budget:.2%}'}</td>"
        f'<td class="links"><a href="/flamegraph.svg?{query}">flame graph ({seconds} s)</a> '
        f'<a href="/debug/pprof/profile?{query}">pprof (collects {seconds} s)</a></td></tr>'
    )


def metrics(vms: Sequence[Vm]) -> str:
    out: list[str] = []

    def family(name: str, kind: str, about: str) -> None:
        out.append(f"# HELP {name} {about}")
        out.append(f"# TYPE {name} {kind}")

    family("qmpprof_vm_up", "gauge", "1 while serve samples the VM, 0 when down or paused")
    out += [f"qmpprof_vm_up{_labels(vm)} {int(vm.up)}" for vm in vms]
    for name, about, attr in (
        ("qmpprof_samples_total", "vCPU samples taken", "samples_total"),
        (
            "qmpprof_offcpu_samples_total",
            "samples of tasks off CPU (--off-cpu: one per task a tick)",
            "off_cpu_total",
        ),
        ("qmpprof_errors_total", "samples that failed (counted, not raised)", "errors_total"),
        ("qmpprof_truncated_total", "samples whose stack walk stopped early", "truncated_total"),
        (
            "qmpprof_truncated_in_kernel_total",
            "samples whose stack walk stopped early at a kernel frame",
            "truncated_in_kernel_total",
        ),
    ):
        family(name, "counter", about)
        out += [f"qmpprof_{name[8:]}{_labels(vm)} {getattr(vm, attr)}" for vm in vms]
    family("qmpprof_pause_seconds", "histogram", "time the guest stood stopped per sample")
    for vm in vms:
        counts, total = list(vm.pause_counts), vm.pause_sum
        running = 0
        for bound, count in zip((*PAUSE_BUCKETS, None), counts, strict=True):
            running += count
            le = "+Inf" if bound is None else f"{bound:g}"
            out.append(f"qmpprof_pause_seconds_bucket{_labels(vm, le=le)} {running}")
        out.append(f"qmpprof_pause_seconds_sum{_labels(vm)} {total:.6f}")
        out.append(f"qmpprof_pause_seconds_count{_labels(vm)} {running}")
    family(
        "qmpprof_sampled_seconds_total",
        "counter",
        "wall time the VM was sampled: pause_seconds_sum over it is its stopped share",
    )
    out += [f"qmpprof_sampled_seconds_total{_labels(vm)} {vm.sampled_seconds:.3f}" for vm in vms]
    lives = [(vm, vm.live()) for vm in vms]
    family("qmpprof_stopped_ratio", "gauge", f"share of the last {LIVE} s the guest stood stopped")
    out += [f"qmpprof_stopped_ratio{_labels(vm)} {live.stopped:.6f}" for vm, live in lives]
    family("qmpprof_rate_hz", "gauge", f"samples (stops) per wall second over the last {LIVE} s")
    out += [f"qmpprof_rate_hz{_labels(vm)} {live.rate_hz:.3f}" for vm, live in lives]
    family("qmpprof_interval_seconds", "gauge", "guest run time between samples, in force")
    out += [f"qmpprof_interval_seconds{_labels(vm)} {vm.interval:.6f}" for vm in vms]
    family(
        "qmpprof_overhead_budget_ratio",
        "gauge",
        "the most of the wall time the guest may stand stopped (absent without a budget)",
    )
    out += [
        f"qmpprof_overhead_budget_ratio{_labels(vm)} {vm.budget:g}"
        for vm in vms
        if vm.budget is not None
    ]
    return "\n".join(out) + "\n"


def _labels(vm: Vm, **extra: str) -> str:
    pairs = {"vm": vm.name, **extra}
    inner = ",".join(f'{key}="{_escape(value)}"' for key, value in pairs.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
