"""Off-CPU samples filed at a tick's time (offcpufiling.OffCpuFiling): each task's stack stored
once per sample object and profile, the frames of the mode kept, a stack left empty counted
filtered."""

from __future__ import annotations

import pytest

from qmpprof.model import NO_CPU, Frame, Mode, Process, Sample, Stack
from qmpprof.offcpufiling import OffCpuFiling
from qmpprof.profile import Profile
from qmpprof.stats import SamplerStats

K = 0xFFFF_FFFF_8000_0000
SLEEPER = Sample(0.0, NO_CPU, Mode.KERNEL, False, 0,
                 Stack((Frame(K + 0x2010, True, "schedule"), Frame(0x40_1010, False, "main"))),
                 Process(5, "sleeper", 0, 5), "S")  # fmt: skip
KERNEL_ONLY = Sample(0.0, NO_CPU, Mode.KERNEL, False, 0,
                     Stack((Frame(K + 0x2010, True, "schedule"),)), Process(2, "kworker", 0, 2),
                     "I")  # fmt: skip


def test_each_tick_files_the_same_stack_at_its_own_time() -> None:
    filing, profile, stats = OffCpuFiling(None), Profile(10.0), SamplerStats()
    for at in (0.01, 0.02, 0.03):
        filing.file([SLEEPER], at, profile, stats)
    assert list(profile.timeline()) == [(0.01, NO_CPU, 0), (0.02, NO_CPU, 0), (0.03, NO_CPU, 0)]
    assert len(profile.stacks) == 1 and stats.filtered == 0
    fresh = Profile(10.0)  # taken: the stack is stored in the new profile again
    filing.file([SLEEPER], 0.04, fresh, stats)
    assert [record.frames for record in fresh.stacks] == [
        record.frames for record in profile.stacks
    ]


@pytest.mark.parametrize(("keep", "kernel"), [(Mode.KERNEL, [True]), (Mode.USER, [False])])
def test_only_the_frames_of_the_mode_kept_and_a_stack_left_empty_is_filtered(
    keep: Mode, kernel: list[bool]
) -> None:
    filing, profile, stats = OffCpuFiling(keep), Profile(10.0), SamplerStats()
    filing.file([SLEEPER, KERNEL_ONLY], 0.01, profile, stats)
    filing.file([SLEEPER, KERNEL_ONLY], 0.02, profile, stats)
    stored = {record.process.pid: record for record in profile.stacks if record.process}
    assert [frame.kernel for frame in profile.frames_of(stored[5])] == kernel
    assert stats.filtered == (2 if keep is Mode.USER else 0)
    assert len(profile) == (2 if keep is Mode.USER else 4)
