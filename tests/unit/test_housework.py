"""The work between ticks (housework.Housework) on scripted jobs: housekeeping then the look,
one round at a time, the look's work held back while the sampler holds the guest stopped, errors
dropped, and the end of a run waiting for the round under way (cancelling it past the grace)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from qmpprof import housework
from qmpprof.errors import TransportError
from qmpprof.housework import Housework


async def test_a_round_is_housekeeping_then_the_look_and_its_errors_pass() -> None:
    done: list[str] = []

    async def housekeeping() -> None:
        done.append("housekeeping")
        raise TransportError("the guest's memory could not be read")

    async def look(running: Callable[[], Awaitable[object]]) -> None:
        await running()
        done.append("look")

    work = Housework(housekeeping, look)
    await work.start()
    await work.finish()
    assert done == ["housekeeping", "look"]
    await Housework(None, None).start()  # nothing to do: no round


async def test_no_round_starts_while_the_last_runs_and_the_look_waits_out_a_pause() -> None:
    released, looked = asyncio.Event(), []

    async def housekeeping() -> None:
        await released.wait()

    async def look(running: Callable[[], Awaitable[object]]) -> None:
        await running()
        looked.append(True)

    work = Housework(housekeeping, look)
    await work.start()
    await work.start()  # the first round still waits: this one is not started
    with work.held():  # the sampler stops the guest
        released.set()
        for _ in range(5):
            await asyncio.sleep(0)  # the housekeeping ends; the look waits for the guest
        assert not looked
    await work.finish()
    assert looked == [True]


async def test_the_end_of_a_run_cancels_a_round_past_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(housework, "GRACE", 0.0)
    cancelled = asyncio.Event()

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()  # never answers
        finally:
            cancelled.set()

    work = Housework(stuck, None)
    await work.start()
    await work.finish()
    assert cancelled.is_set()
