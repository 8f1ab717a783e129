"""The work between ticks while the guest runs: the guest OS's housekeeping (its slow changes,
e.g. modules loaded) and the off-CPU look at every task, never inside a pause.

A job starts after a tick unless the last one still runs, beside the wait for the next tick: it
runs up to its first wait at once, the rest while the sampler waits, so that a long job (a
process's mappings read over QMP) never holds the next tick back. Its errors are dropped (a
guest gone shows at the next stop). The sampler holds the work back while it keeps the guest
stopped (``held``): a job's reads wait for ``running``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator

from qmpprof.errors import QmpprofError

GRACE = 1.0  # seconds the end of a run waits for the work under way

Job = Callable[[], Awaitable[None]]
# The off-CPU look: given a wait for the guest to run, awaited before each piece of its work.
Look = Callable[[Callable[[], Awaitable[object]]], Awaitable[None]]


class Housework:
    """``housekeeping`` then ``look`` (either may be None), one round at a time."""

    def __init__(self, housekeeping: Job | None, look: Look | None) -> None:
        self.housekeeping = housekeeping
        self.look = look
        self._running = asyncio.Event()  # cleared while the sampler holds the guest stopped
        self._running.set()
        self._under_way: asyncio.Future[None] | None = None

    async def running(self) -> None:
        """Return once the sampler does not hold the guest stopped."""
        await self._running.wait()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While the sampler stops the guest: from now no job's read starts."""
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()

    async def start(self) -> None:
        """A round of every job, unless the last one still runs. Its reads may meet a pause
        (then one of them delays it a little)."""
        jobs = [self.housekeeping] if self.housekeeping is not None else []
        if self.look is not None:
            jobs.append(functools.partial(self.look, self.running))
        if not jobs or not (self._under_way is None or self._under_way.done()):
            return
        self._under_way = asyncio.ensure_future(_round(jobs))
        await asyncio.sleep(0)

    async def finish(self) -> None:
        """No work left running: what runs is let finish, GRACE at most (then cancelled)."""
        work, self._under_way = self._under_way, None
        if work is None or work.done():
            return
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(work, GRACE)


async def _round(jobs: list[Job]) -> None:
    for job in jobs:
        with contextlib.suppress(QmpprofError):
            await job()
