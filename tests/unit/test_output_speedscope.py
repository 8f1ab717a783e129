"""speedscope JSON: shared frames, one time-ordered sampled profile per vCPU, run metadata."""

from __future__ import annotations

import json
from typing import Any

from test_output import hand_built_profile

from qmpprof import __version__
from qmpprof.naming import Naming
from qmpprof.output import speedscope
from qmpprof.profile import Profile


def document(profile: Profile) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(speedscope.render(profile, Naming()))
    return loaded


def stacks(doc: dict[str, Any], index: int) -> list[tuple[str, ...]]:
    names = [frame["name"] for frame in doc["shared"]["frames"]]
    return [tuple(names[i] for i in sample) for sample in doc["profiles"][index]["samples"]]


def test_top_level_names_the_schema_the_run_and_the_exporter() -> None:
    doc = document(hand_built_profile())
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    assert doc["name"] == "qmpprof: fixtures/guest/emerald.elf"
    assert doc["exporter"] == f"qmpprof@{__version__}"


def test_frames_are_shared_once_per_name() -> None:
    doc = document(hand_built_profile())
    names = [frame["name"] for frame in doc["shared"]["frames"]]
    assert len(names) == len(set(names)) == 13
    assert names[:3] == ["kernel", "kmain_[k]", "idle_loop_[k]"]  # first seen first


def test_one_profile_per_vcpu_with_samples_in_time_order() -> None:
    doc = document(hand_built_profile())
    assert [p["name"] for p in doc["profiles"]] == ["vcpu 0", "vcpu 1"]
    assert stacks(doc, 1) == [
        ("worker (pid 4)", "_start", "main", "compute", "compute"),
        ("worker (pid 4)", "_start", "main", "compute"),  # recorded last, taken second
        ("kernel", "[truncated]", "page_fault_[k]"),
        ("worker (pid 4)", "_start", "main", "compute", "compute"),
    ]
    assert stacks(doc, 0)[2][-1] == "sys_read_[k]"


def test_each_sample_weighs_one_interval_and_the_axis_spans_the_weights() -> None:
    """Weights and axis in one clock, guest run time: the hand-built samples are 10 ms of wall
    time apart, a 2.5 ms interval each, so an axis from the times would end in an empty tail."""
    profile = hand_built_profile()
    profile.interval_ms = 2.5
    for sample in document(profile)["profiles"]:
        assert sample["type"] == "sampled"
        assert sample["unit"] == "milliseconds"
        assert sample["weights"] == [2.5] * len(sample["samples"])
        assert sample["startValue"] == 0
        assert sample["endValue"] == sum(sample["weights"]) == 10.0


def test_an_empty_profile_has_no_profiles() -> None:
    doc = document(Profile())
    assert doc["profiles"] == []
    assert doc["shared"]["frames"] == []
    assert doc["name"] == "qmpprof profile"
