"""speedscope JSON: one sampled profile per vCPU over a shared, de-duplicated frame table and,
when the run holds tasks off CPU, one per thread after them.

Format: https://www.speedscope.app/file-format-schema.json. Samples stay in time order, because
speedscope's "Time Order" view draws them in file order; each weighs one sampling interval of
guest run time (the clock qmpprof's interval and duration count). speedscope lays samples end
to end by weight and stretches the axis to ``endValue``, so a lane spans exactly its weights,
from 0: the axis is guest run time too (the wall time between samples also holds the pauses,
which the guest did not run; an axis in it would end in an empty tail).

A vCPU's lane is what that vCPU ran (the CPU view). A thread's lane, "comm (pid/tid)", holds its
samples on a CPU and off it ([off-cpu: S] under the root): with --off-cpu a thread has a sample
at every tick wherever it is, so its lane spans the whole run (the wall-clock view, as py-spy
--idle gives, in guest run time). A run without off-CPU samples has no thread lanes: a thread's
on-CPU samples alone would be its CPU time drawn as if it were its whole time.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from qmpprof import __version__
from qmpprof.model import NO_CPU
from qmpprof.naming import Naming, thread_name
from qmpprof.output.facts import title
from qmpprof.profile import Profile

SCHEMA = "https://www.speedscope.app/file-format-schema.json"
UNIT = "milliseconds"

Timeline = list[tuple[float, int, int]]  # (time, vCPU, stack id) per sample, in time order


def _lane(name: str, timeline: Timeline, frames: list[list[int]], interval_ms: float) -> Any:
    samples = [frames[sid] for _time, _cpu, sid in timeline]
    return {
        "type": "sampled",
        "name": name,
        "unit": UNIT,
        "startValue": 0,
        "endValue": round(interval_ms * len(samples), 3),
        "samples": samples,
        "weights": [interval_ms] * len(samples),
    }


def _threads(profile: Profile, ordered: Timeline) -> dict[tuple[int, int], tuple[str, Timeline]]:
    """Per thread (pid, tid) of a guest that tells threads apart: its name and samples."""
    lanes: dict[tuple[int, int], tuple[str, Timeline]] = {}
    for entry in ordered:
        process = profile.stacks[entry[2]].process
        if process is None or process.pid is None or process.tid is None:
            continue  # no thread to file it under: it stays in its vCPU's lane
        key = (process.pid, process.tid)
        if key not in lanes:
            lanes[key] = (thread_name(process), [])
        lanes[key][1].append(entry)
    return lanes


def render(profile: Profile, naming: Naming) -> str:
    # A stable sort: samples taken at the same instant keep the sampler's order.
    ordered = sorted(profile.timeline(), key=lambda entry: entry[0])
    named = profile.named(naming)
    frame_index: dict[str, int] = {}
    frames: list[list[int]] = [[] for _ in named]  # per stack id, its frame indices
    for _time, _cpu, sid in ordered:
        if not frames[sid]:
            frames[sid] = [frame_index.setdefault(n, len(frame_index)) for n in named[sid].names]
    by_cpu: defaultdict[int, Timeline] = defaultdict(list)
    for entry in ordered:
        by_cpu[entry[1]].append(entry)
    interval = profile.interval_ms
    profiles = [_lane(f"vcpu {cpu}", by_cpu[cpu], frames, interval) for cpu in profile.cpus]
    if NO_CPU in by_cpu:
        threads = _threads(profile, ordered)
        profiles += [_lane(*threads[key], frames, interval) for key in sorted(threads)]
    document = {
        "$schema": SCHEMA,
        "name": title(profile),
        "exporter": f"qmpprof@{__version__}",
        "shared": {"frames": [{"name": name} for name in frame_index]},
        "profiles": profiles,
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n"
