"""scripts/bench: its arithmetic and reports by hand (every sampling method against the bundled
guest: tests/e2e/test_bench_guest.py)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from support.bench import intervals, report, startup
from support.bench import run as bench_run
from support.bench.methods import (
    Paced,
)
from support.bench.run import Alternated, Run, percentile


def test_percentile_and_rate() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.95) == 96.0
    assert percentile([3.0], 0.95) == 3.0
    assert Paced([0.001] * 50, elapsed=2.0).rate == 25.0


def test_slowdown_and_its_standard_error() -> None:
    alt = Alternated(sampled=[90.0, 70.0], idle=[100.0, 100.0])
    slowdown, se = alt.slowdown()
    assert slowdown == pytest.approx(0.2)
    # variance of the sampled stretches (200) plus the idle ones (0), over 2 pairs, / 100
    assert se == pytest.approx((200 / 2) ** 0.5 / 100)
    assert Alternated().slowdown() == (None, None)


def _run(
    method: str, interval: float, median: float | None, slowdown: float | None, smp: int = 1
) -> Run:
    return Run(
        method, interval, 10, 0, median, median, 50.0, 0.1, 90.0, 100.0, slowdown, 0.01, smp=smp
    )


def test_two_vcpu_keys_and_the_targets() -> None:
    runs = [
        _run("floor", 10.0, 4.0, 0.2),
        _run("qmpprof-default", 10.0, 1.0, 0.11),
        _run("gdbstub", 10.0, 0.8, 0.1),
        _run("gdb-loop", 10.0, 2.0, 0.3),
        _run("qmpprof-default", 10.0, 2.0, 0.2, smp=2),
        _run("floor", 10.0, 6.0, 0.3, smp=2),
    ]
    head = report.headline(runs, 10.0)
    assert head["default_pause_ms"] == 1.0 and head["default_pause_ms_smp2"] == 2.0
    assert head["floor_pause_ms_smp2"] == 6.0 and "gdbstub_pause_ms_smp2" not in head
    assert head["gdbstub_overhead_100hz"] == head["gdbstub_loop_overhead_100hz"] == 0.1
    assert head["default_overhead_100hz_smp2"] == 0.2
    assert head["rate_hz"]["qmpprof-default_smp2"] == {"10ms": 50.0}
    met = report.targets({**head, "first_pause_ms": 3.0})
    assert met["default vs floor"] == {"ratio": 0.25, "limit": 0.45, "met": True}
    assert met["default vs gdb in a loop"]["met"] is True  # 0.5
    assert met["default vs bare gdbstub slowdown"]["ratio"] == pytest.approx(1.1)
    assert met["default, 2 vCPUs vs 1"] == {"ratio": 2.0, "limit": 1.5, "met": False}
    assert met["first pause vs default"]["met"] is False  # 3x
    assert report.targets({})["default vs floor"]["met"] is None
    table = report.table({"runs": [r.__dict__ for r in runs], "baseline_progress_per_s": [1, 1],
                          "targets": met, **head})  # fmt: skip
    assert "qmpprof-default (2 vCPUs)" in table
    assert "target default, 2 vCPUs vs 1: 2.00x (at most 1.5x): NOT met" in table


def test_headline_keys_and_table() -> None:
    runs = [
        _run("floor", 10.0, 1.5, 0.2),
        _run("gdbstub", 10.0, 0.5, 0.05),
        _run("gdbstub", 2.0, 0.4, 0.2),
        _run("qmpprof-qmp", 10.0, 3.0, 0.25),
    ]
    head = report.headline(runs, 10.0)
    assert head["floor_pause_ms"] == 1.5
    assert head["gdbstub_pause_ms"] == 0.5  # the 10 ms run, not the 2 ms one
    assert head["qmp_overhead_100hz"] == 0.25
    assert head["gdb_batch_pause_ms"] is None  # not measured: reported as missing
    assert (head["qmp_stopped_100hz"], head["qmp_overhead_100hz_se"]) == (0.1, 0.01)
    assert head["rate_hz"]["gdbstub"] == {"10ms": 50.0, "2ms": 50.0}
    result: dict[str, Any] = {
        "runs": [r.__dict__ for r in runs],
        "baseline_progress_per_s": [100.0, 101.0],
        "elf_load_ms": 2.0,
        "offline_samples_per_s": None,
        **head,
    }
    text = report.table(result)
    floor_row = next(line for line in text.splitlines() if line.startswith("floor"))
    assert "1.00" in floor_row and "3.00" in floor_row  # x floor, x gdbstub
    qmp_row = next(line for line in text.splitlines() if line.startswith("qmpprof-qmp"))
    assert "2.00" in qmp_row and "6.00" in qmp_row
    assert json.loads(report.to_json(result))["floor_pause_ms"] == 1.5


def test_the_bench_finds_the_checkout_and_its_entry_point_runs() -> None:
    assert (bench_run.ROOT / "scripts" / "run-guest").is_file()
    done = subprocess.run(
        [str(bench_run.ROOT / "scripts" / "bench"), "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "--soak" in done.stdout, done.stderr


def test_the_churn_targets_are_a_floor_and_a_ceiling() -> None:
    met = report.targets({"linux_churn_rate_share": 0.97, "linux_churn_wall_ratio": 1.3})
    assert met["Linux churn: rate in run time vs asked"]["met"] is True
    assert met["Linux churn: wall vs run time asked + pauses"]["met"] is False
    low = report.targets({"linux_churn_rate_share": 0.9, "linux_churn_wall_ratio": 1.1})
    assert low["Linux churn: rate in run time vs asked"]["met"] is False
    assert low["Linux churn: wall vs run time asked + pauses"]["met"] is True
    assert report.targets({})["Linux churn: rate in run time vs asked"]["met"] is None
    table = report.table({"runs": [], "baseline_progress_per_s": [1, 1], "targets": low})
    assert "rate in run time vs asked: 0.90x (at least 0.95x): NOT met" in table


def test_startup_is_the_ratio_of_the_medians() -> None:
    found = startup.summary([200.0, 180.0, 400.0], [30.0, 20.0, 40.0])
    assert found == {"startup_ms": 200.0, "startup_python_ms": 30.0, "startup_ratio": 6.67}


def test_the_interval_ratios_are_of_the_medians() -> None:
    found = intervals.summary([1.0, 2.0, 9.0], [3.0, 4.0, 5.0, 6.0], [4.0])
    assert found["pause_10ms_ms"] == 2.0 and found["pause_1s_ms"] == 4.5
    assert found["pause_interval_ratio"] == 2.25 and found["serve_pause_ratio"] == 2.0
    missing = intervals.summary([2.0], [], [])
    assert missing["pause_interval_ratio"] is None and missing["serve_pause_ratio"] is None


def test_the_host_touch_ratio_is_of_the_medians() -> None:
    found = intervals.host_touch({0.010: [0.2, 0.3, 0.1], 1.0: [4.0, 5.0, 6.0]})
    assert found == {"host_touch_10ms_ms": 0.2, "host_touch_1s_ms": 5.0, "host_touch_ratio": 25.0}


def test_the_pause_ratios_come_from_keys_of_the_same_run() -> None:
    result = {"default_pause_ms": 1.2, "gdbstub_pause_ms": 1.0, "first_pause_ms": 3.0}
    assert intervals.ratios(result) == {"default_pause_ratio": 1.2, "first_pause_ratio": 2.5}
    assert intervals.ratios({"default_pause_ms": 1.2, "gdbstub_pause_ms": None}) == {
        "default_pause_ratio": None,
        "first_pause_ratio": None,
    }
    met = report.targets({"pause_interval_ratio": 1.6, "first_pause_ratio": 2.0})
    assert met["pause at a 1 s interval vs 10 ms"]["met"] is False
    assert met["a run's first pause vs the default's median"]["met"] is True
    assert met["serve's pause vs the command's at 10 ms"]["met"] is None
