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


def test_a_listing_names_frames_by_the_outputs_rule_and_each_module_once() -> None:
    """``_[k]`` on kernel code as in every output; a kernel module's frame carries its module in
    its name already (it was ``qb_read+0x10 [qmpprof_burn] ([qmpprof_burn])``)."""
    burn = Mapping("[qmpprof_burn]", 0xFFFF_FFFF_C000_0000, 0xFFFF_FFFF_C000_4000, True)
    start, bias = 0x7F00_0000_3000, 0x7F00_0000_0000
    lib = Mapping("liblzma.so.5", start, 0x7F00_0002_0000, False, bias, "/lib/liblzma.so.5")
    listed = text.one_shot_text(
        [
            sample(
                Frame(0xFFFF_FFFF_C000_0010, True, "qb_read", 0x10, burn),
                Frame(0xFFFF_FFFF_8100_0010, True, "schedule", 0x10, KERNEL),
                Frame(0x7F00_0001_F2E0, False, None, 0, lib),
                Frame(0x40_1010, False, "main", 0x10, Mapping("sh", 0x40_0000, 0x50_0000, False)),
            )
        ],
        show_addresses=False,
    )
    assert listed.splitlines()[1:] == [
        "  #0  qb_read+0x10 [qmpprof_burn]_[k]",
        "  #1  schedule+0x10_[k] (vmlinux)",
        "  #2  [unknown] [liblzma.so.5+0x1f2e0]",
        "  #3  main+0x10 (sh)",
    ]
