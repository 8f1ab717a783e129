"""When the next tick is due (pacing.Pacing), by hand: a full interval of guest run time after
the guest ran again, less what the last tick came late by, at most one interval made up."""

from __future__ import annotations

import pytest

from qmpprof.pacing import Pacing


def test_a_tick_is_due_a_full_interval_after_the_guest_ran_again() -> None:
    pacing = Pacing(0.0, lambda: 0.5)
    assert pacing.wait(0.010, 0.0) == pytest.approx(0.010)
    assert pacing.wait(0.010, 0.003) == pytest.approx(0.007)  # ran 3 ms already (naming)
    assert pacing.wait(0.010, 0.020) == 0.0  # overdue: at once, never a negative sleep


def test_lateness_is_made_up_at_the_next_tick_at_most_one_interval() -> None:
    pacing = Pacing(0.0, lambda: 0.5)
    pacing.wait(0.010, 0.0)
    pacing.ran(0.0115)  # woke 1.5 ms late
    assert pacing.wait(0.010, 0.0) == pytest.approx(0.0085)
    pacing.ran(0.0085 + 0.030)  # a 30 ms stall on top of the 1.5 ms owed
    assert pacing.late == pytest.approx(0.010)  # one interval, not 31.5 ms: no burst
    assert pacing.wait(0.010, 0.0) == 0.0
    pacing.ran(0.0)  # came at once: 10 ms owed were made up
    assert pacing.late == 0.0


def test_a_held_stop_counts_as_lateness_capped_at_one_interval() -> None:
    pacing = Pacing(0.0, lambda: 0.5)
    pacing.wait(0.010, 0.0)
    pacing.ran(0.010)
    pacing.held(0.004)  # the guest ran on 4 ms while the tick waited for a look's read
    assert pacing.wait(0.010, 0.0) == pytest.approx(0.006)
    pacing.ran(0.006)
    pacing.held(0.050)
    assert pacing.late == pytest.approx(0.010)


def test_jitter_scales_each_interval_by_the_draw() -> None:
    draws = iter([0.0, 1.0, 0.5])
    pacing = Pacing(0.5, draws.__next__)
    assert [pacing.wait(0.010, 0.0) for _ in range(3)] == pytest.approx([0.005, 0.015, 0.010])
    assert pacing.interval == pytest.approx(0.010)  # lateness is measured against this one
