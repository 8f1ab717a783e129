"""speedscope JSON: one sampled profile per vCPU over a shared, de-duplicated frame table.

Format: https://www.speedscope.app/file-format-schema.json. Samples stay in time order, because
speedscope's "Time Order" view draws them in file order; each weighs one sampling interval.
"""

from __future__ import annotations

import json
from typing import Any

from qmpprof import __version__
from qmpprof.output.facts import title
from qmpprof.profile import Profile, TimedStack

SCHEMA = "https://www.speedscope.app/file-format-schema.json"
UNIT = "milliseconds"


def _ms(seconds: float) -> float:
    # Rounded to the microsecond so float noise (0.030000000000000002) never reaches the file.
    return round(seconds * 1000, 3)


def _cpu_profile(
    cpu: int, stacks: list[TimedStack], frame_index: dict[str, int], interval_ms: float
) -> dict[str, Any]:
    samples = [[frame_index[name] for name in stack.names] for stack in stacks]
    return {
        "type": "sampled",
        "name": f"vcpu {cpu}",
        "unit": UNIT,
        "startValue": _ms(stacks[0].time),
        "endValue": round(_ms(stacks[-1].time) + interval_ms, 3),
        "samples": samples,
        "weights": [interval_ms] * len(samples),
    }


def render(profile: Profile) -> str:
    # A stable sort: samples taken at the same instant keep the sampler's order.
    ordered = sorted(profile.samples, key=lambda s: s.time)
    frame_index: dict[str, int] = {}
    for stack in ordered:
        for name in stack.names:
            frame_index.setdefault(name, len(frame_index))
    profiles = [
        _cpu_profile(cpu, [s for s in ordered if s.cpu == cpu], frame_index, profile.interval_ms)
        for cpu in profile.cpus
    ]
    document = {
        "$schema": SCHEMA,
        "name": title(profile),
        "exporter": f"qmpprof@{__version__}",
        "shared": {"frames": [{"name": name} for name in frame_index]},
        "profiles": profiles,
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n"
