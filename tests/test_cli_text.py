"""What the command line prints for a one-shot (cli/text.py), on frames built by hand."""

from __future__ import annotations

import json

from qmpprof.cli import text
from qmpprof.model import Frame, Mapping, Mode, Sample, Stack

KERNEL = Mapping("vmlinux", 0xFFFF_FFFF_8100_0000, 0xFFFF_FFFF_8300_0000, True)


def sample(*frames: Frame) -> Sample:
    return Sample(0.0, 0, Mode.KERNEL, False, 0x1000, Stack(frames))


def test_json_frames_say_which_are_kernel_inlined_and_put_back_from_tail_calls() -> None:
    leaf = 0xFFFF_FFFF_8100_0040
    frames = (
        Frame(leaf, True, "inlined_helper", 0, KERNEL, inlined=True),
        Frame(leaf, True, "clockevents", 0x40, KERNEL),
        Frame(0xFFFF_FFFF_8100_1010, True, "tick", 0x10, KERNEL, tail_call=True),
        Frame(0xFFFF_FFFF_8100_2020, True, "caller", 0x20, KERNEL),
        Frame(0x40_1000, False, "main", 0),
    )
    (doc,) = json.loads(text.one_shot_json([sample(*frames)]))
    marks = [(f["symbol"], f["kernel"], f["inlined"], f["tail_call"]) for f in doc["frames"]]
    assert marks == [
        ("inlined_helper", True, True, False),
        ("clockevents", True, False, False),
        ("tick", True, False, True),
        ("caller", True, False, False),
        ("main", False, False, False),
    ]
