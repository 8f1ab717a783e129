"""The tasks off CPU as a sampling run sees them: the seam a guest OS's off-CPU reader fills
(``OffCpu``: looks while the guest runs, samples at each tick), and the filing of a tick's
off-CPU samples into the profile at the tick's time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from qmpprof.memo import Memo
from qmpprof.model import NO_CPU, Mode, Sample, Stack
from qmpprof.profile import Profile
from qmpprof.stats import SamplerStats


class OffCpu(Protocol):
    """The tasks off CPU: ``look`` while the guest runs (its own schedule), ``samples`` after
    each tick: those of the tasks not on a vCPU at that tick (its samples ``on_cpu``)."""

    async def look(self, running: Callable[[], Awaitable[object]]) -> None:
        """``running``: waits while the guest is stopped (awaited before each piece of work,
        so that none of it runs inside a pause)."""
        ...

    async def quiet(self) -> None:
        """Return when none of the look's reads is under way: the sampler stops the guest
        only then (``running`` is cleared first: no read starts meanwhile)."""
        ...

    def samples(self, on_cpu: Sequence[Sample]) -> Sequence[Sample]:
        """The tick's: the same objects from tick to tick while a task stands still (the
        sampler knows their stacks by identity), their time the tick's, not theirs."""
        ...


class OffCpuFiling:
    """Files a tick's off-CPU samples, each by its stack's id, found once per sample object
    and profile (hashing a task's frames at every tick was most of a tick's cost).
    ``keep``: under --kernel-only or --user-only, only the frames of that mode are filed."""

    def __init__(self, keep: Mode | None) -> None:
        self.keep = keep
        self._ids: Memo[int, tuple[Sample, int | None]] = Memo()  # id(sample) ->
        self._profile: Profile | None = None  # the profile those ids are of

    def file(
        self, samples: Sequence[Sample], at: float, profile: Profile, stats: SamplerStats
    ) -> None:
        """``samples`` into ``profile`` at time ``at``; one with no frame kept is counted
        filtered in ``stats``."""
        if self._profile is not profile:
            self._profile = profile
            self._ids.clear()
        ids = self._ids
        for sample in samples:
            known = ids.get(id(sample))
            # The entry holds the sample, so no other object can take its id meanwhile.
            if known is None or known[0] is not sample:
                known = ids.put(id(sample), (sample, self._stack_id(sample, profile)))
            if known[1] is None:
                stats.filtered += 1
            else:
                profile.add_at(at, NO_CPU, known[1])

    def _stack_id(self, sample: Sample, profile: Profile) -> int | None:
        """A task off CPU's stack id: of the frames of the mode kept (None: none)."""
        keep = self.keep
        if keep is not None:
            frames = tuple(f for f in sample.stack.frames if f.kernel == (keep is Mode.KERNEL))
            if not frames:
                return None
            sample = dataclasses.replace(sample, stack=Stack(frames, sample.stack.stop))
        return profile.stack_id(sample)
