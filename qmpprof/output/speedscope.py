"""speedscope JSON: one sampled profile per vCPU over a shared, de-duplicated frame table.

Format: https://www.speedscope.app/file-format-schema.json. Samples stay in time order, because
speedscope's "Time Order" view draws them in file order; each weighs one sampling interval.
"""

from __future__ import annotations

import json
from typing import Any

from qmpprof import __version__
from qmpprof.model import NO_CPU
from qmpprof.naming import Naming
from qmpprof.output.facts import title
from qmpprof.profile import Profile

SCHEMA = "https://www.speedscope.app/file-format-schema.json"
UNIT = "milliseconds"


def _ms(seconds: float) -> float:
    # Rounded to the microsecond so float noise (0.030000000000000002) never reaches the file.
    return round(seconds * 1000, 3)


def _cpu_profile(
    cpu: int, timeline: list[tuple[float, int, int]], frames: list[list[int]], interval_ms: float
) -> dict[str, Any]:
    samples = [frames[sid] for _time, _cpu, sid in timeline]
    return {
        "type": "sampled",
        "name": "off cpu" if cpu == NO_CPU else f"vcpu {cpu}",
        "unit": UNIT,
        "startValue": _ms(timeline[0][0]),
        "endValue": round(_ms(timeline[-1][0]) + interval_ms, 3),
        "samples": samples,
        "weights": [interval_ms] * len(samples),
    }


def render(profile: Profile, naming: Naming) -> str:
    # A stable sort: samples taken at the same instant keep the sampler's order.
    ordered = sorted(profile.timeline(), key=lambda entry: entry[0])
    named = profile.named(naming)
    frame_index: dict[str, int] = {}
    frames: list[list[int]] = [[] for _ in named]  # per stack id, its frame indices
    for _time, _cpu, sid in ordered:
        if not frames[sid]:
            frames[sid] = [frame_index.setdefault(n, len(frame_index)) for n in named[sid].names]
    profiles = [
        _cpu_profile(cpu, [e for e in ordered if e[1] == cpu], frames, profile.interval_ms)
        for cpu in sorted(set(profile.cpus_of))  # the tasks off CPU (NO_CPU) last, one lane
    ]
    document = {
        "$schema": SCHEMA,
        "name": title(profile),
        "exporter": f"qmpprof@{__version__}",
        "shared": {"frames": [{"name": name} for name in frame_index]},
        "profiles": profiles,
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n"
