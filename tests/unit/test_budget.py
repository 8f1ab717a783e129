"""The overhead budget (budget.OverheadBudget), by hand: the interval in force follows the
pauses (weighted towards the recent ones) within [the interval asked, the ceiling], and a
budgeted run ends by guest run time."""

from __future__ import annotations

import pytest

from qmpprof.budget import HEADROOM, OverheadBudget


def test_without_a_budget_the_interval_stays_and_the_run_ends_by_ticks() -> None:
    budget = OverheadBudget(0.010, None, 1.0)
    budget.adapt(0.5)
    assert budget.interval == 0.010
    assert not budget.spent(100.0, 5.0)


def test_the_interval_keeps_pause_over_pause_plus_interval_at_the_aim() -> None:
    budget = OverheadBudget(0.002, 0.2, 1.0)
    budget.adapt(0.005)  # the first pause is the average
    aim = 0.2 * HEADROOM
    assert budget.interval == pytest.approx(0.005 * (1 - aim) / aim)
    assert 0.005 / (0.005 + budget.interval) == pytest.approx(aim)


def test_pauses_are_weighted_towards_the_recent_ones() -> None:
    budget = OverheadBudget(0.001, 0.5, 10.0)
    budget.adapt(0.010)
    budget.adapt(0.020)
    average = 0.8 * 0.010 + 0.2 * 0.020
    aim = 0.5 * HEADROOM
    assert budget.interval == pytest.approx(average * (1 - aim) / aim)


def test_the_interval_stays_between_the_one_asked_and_the_ceiling() -> None:
    budget = OverheadBudget(0.010, 0.01, 0.2)
    budget.adapt(0.004)  # would need 0.44 s
    assert budget.interval == 0.2
    cheap = OverheadBudget(0.010, 0.2, 1.0)
    cheap.adapt(0.00001)
    assert cheap.interval == 0.010
    assert OverheadBudget(0.5, 0.2, 0.1).ceiling == 0.5  # never below the interval asked


def test_a_budgeted_run_ends_when_its_run_time_reaches_the_duration() -> None:
    budget = OverheadBudget(0.010, 0.2, 1.0)
    assert not budget.spent(4.99, 5.0)
    assert budget.spent(5.0, 5.0)
