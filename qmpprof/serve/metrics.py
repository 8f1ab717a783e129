"""serve's Prometheus metrics, through ``prometheus_client``: a collector that reads each VM's
numbers once a scrape (from the HTTP thread), in a ``CollectorRegistry`` of the daemon's own
(never the library's global one: two daemons in one process keep theirs apart), written in the
text exposition format 0.0.4.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from qmpprof.serve.vm import LIVE, PAUSE_BUCKETS, Vm

# The format generate_latest writes (CONTENT_TYPE_LATEST names 1.0.0: checked on 0.26).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = (  # name (prometheus_client adds _total), help, Vm attribute
    ("qmpprof_samples", "vCPU samples taken", "samples_total"),
    (
        "qmpprof_offcpu_samples",
        "samples of tasks off CPU (--off-cpu: one per task a tick)",
        "off_cpu_total",
    ),
    ("qmpprof_errors", "samples that failed (counted, not raised)", "errors_total"),
    ("qmpprof_truncated", "samples whose stack walk stopped early", "truncated_total"),
    (
        "qmpprof_truncated_in_kernel",
        "samples whose stack walk stopped early at a kernel frame",
        "truncated_in_kernel_total",
    ),
)


class VmCollector:
    """The metric families of the VMs ``vms()`` gives at each scrape, labelled by ``vm``."""

    def __init__(self, vms: Callable[[], Sequence[Vm]]) -> None:
        self._vms = vms

    def collect(self) -> Iterator[Metric]:
        vms = self._vms()
        up = _gauge("qmpprof_vm_up", "1 while serve samples the VM, 0 when down or paused")
        for vm in vms:
            up.add_metric([vm.name], int(vm.up))
        yield up
        for name, about, attr in _COUNTERS:
            counter = CounterMetricFamily(name, about, labels=["vm"])
            for vm in vms:
                counter.add_metric([vm.name], getattr(vm, attr))
            yield counter
        yield _pauses(vms)
        sampled = CounterMetricFamily(
            "qmpprof_sampled_seconds",
            "wall time the VM was sampled: pause_seconds_sum over it is its stopped share",
            labels=["vm"],
        )
        for vm in vms:
            sampled.add_metric([vm.name], vm.sampled_seconds)
        yield sampled
        yield from _live(vms)


def _gauge(name: str, about: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, about, labels=["vm"])


def _pauses(vms: Sequence[Vm]) -> HistogramMetricFamily:
    out = HistogramMetricFamily(
        "qmpprof_pause_seconds", "time the guest stood stopped per sample", labels=["vm"]
    )
    for vm in vms:
        counts, total = list(vm.pause_counts), vm.pause_sum
        buckets, running = [], 0
        for bound, count in zip((*PAUSE_BUCKETS, None), counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound is None else f"{bound:g}", running))
        out.add_metric([vm.name], buckets, total)
    return out


def _live(vms: Sequence[Vm]) -> Iterator[GaugeMetricFamily]:
    lives = [(vm, vm.live()) for vm in vms]
    stopped = _gauge("qmpprof_stopped_ratio", f"share of the last {LIVE} s the guest stood stopped")
    rate = _gauge("qmpprof_rate_hz", f"samples (stops) per wall second over the last {LIVE} s")
    for vm, live in lives:
        stopped.add_metric([vm.name], live.stopped)
        rate.add_metric([vm.name], live.rate_hz)
    interval = _gauge("qmpprof_interval_seconds", "guest run time between samples, in force")
    budget = _gauge(
        "qmpprof_overhead_budget_ratio",
        "the most of the wall time the guest may stand stopped (absent without a budget)",
    )
    for vm in vms:
        interval.add_metric([vm.name], vm.interval)
        if vm.budget is not None:
            budget.add_metric([vm.name], vm.budget)
    yield from (stopped, rate, interval, budget)


def scraper(vms: Callable[[], Sequence[Vm]]) -> Callable[[], bytes]:
    """What writes the metrics of ``vms`` (a registry of its own, made here, holds them)."""
    registry = CollectorRegistry()
    registry.register(VmCollector(vms))
    return partial(generate_latest, registry)
