"""One VM's recent past, second by second, in bounded memory.

Each ``SecondSlice`` holds what one second of sampling collected: counted stacks per vCPU, ticks,
pauses, errors. A ``Ring`` keeps the last ``window`` of them. A stack seen in many seconds is
stored once (interned); when the last second holding it leaves the ring, it is dropped, so
memory follows the window, never the uptime. A ``SecondSlice`` is immutable and the ring's tuple is
replaced whole, so the HTTP threads read a consistent snapshot without a lock; merging the
seconds they took into a ``Profile`` happens in those threads, away from the sampling loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.model import Frame, Mode, Process, Sample, Stack, StopReason
from qmpprof.profile import Profile

# who, mode, how the walk ended, frames, and off CPU the task's state (None on a CPU)
StackKey = tuple[Process | None, Mode, StopReason, tuple[Frame, ...], str | None]


@dataclass(frozen=True, slots=True)
class SecondSlice:
    """What one second (roughly: from ``start`` to ``end``, monotonic) of sampling gave."""

    start: float
    end: float
    counts: tuple[tuple[StackKey, int, int], ...]  # (stack, vCPU, samples)
    ticks: int
    errors: int
    pauses: tuple[float, ...]  # seconds the guest stood stopped, per tick

    @property
    def samples(self) -> int:
        """vCPU samples (tasks off CPU are counted apart, in ``off_cpu``)."""
        return sum(count for key, _, count in self.counts if key[4] is None)

    @property
    def off_cpu(self) -> int:
        """Samples of tasks off CPU (--off-cpu)."""
        return sum(count for key, _, count in self.counts if key[4] is not None)

    @property
    def truncated(self) -> int:
        """vCPU samples whose walk stopped early."""
        return sum(count for key, _, count in self.counts if key[4] is None and not key[2].whole)

    @property
    def truncated_in_kernel(self) -> int:
        """Walks that stopped early at a kernel frame: the kernel's image or its modules did
        not tell how to go on (a kernel file that is not the one the guest runs shows here);
        the rest stopped in user code (a program without CFI, a file missing in --user-dir)."""
        return sum(
            count
            for key, _, count in self.counts
            if key[4] is None and not key[2].whole and key[3] and key[3][-1].kernel
        )


class Ring:
    """The last ``window`` seconds of one VM; ``push`` from the sampling loop only."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError("the window must hold at least one second")
        self.window = window
        self.seconds: tuple[SecondSlice, ...] = ()
        self._stacks: dict[StackKey, StackKey] = {}  # each stack once
        self._refs: Counter[StackKey] = Counter()  # how many entries of the ring hold it

    def push(
        self,
        profile: Profile,
        start: float,
        end: float,
        *,
        ticks: int,
        errors: int,
        pauses: Sequence[float],
    ) -> SecondSlice:
        """Add the second ``profile`` collected; the oldest second leaves when the ring is
        full."""
        per_cpu = Counter(zip(profile.stack_of, profile.cpus_of, strict=True))
        counts = []
        for (sid, cpu), count in per_cpu.items():
            record = profile.stacks[sid]
            frames = tuple(profile.frames_of(record))
            key = (record.process, record.mode, record.stop, frames, record.state)
            key = self._stacks.setdefault(key, key)
            self._refs[key] += 1
            counts.append((key, cpu, count))
        second = SecondSlice(start, end, tuple(counts), ticks, errors, tuple(pauses))
        kept = self.seconds[-(self.window - 1) :] if self.window > 1 else ()
        for gone in self.seconds[: len(self.seconds) - len(kept)]:
            self._release(gone)
        self.seconds = (*kept, second)
        return second

    def _release(self, second: SecondSlice) -> None:
        for key, _, _ in second.counts:
            self._refs[key] -= 1
            if self._refs[key] <= 0:
                del self._refs[key]
                del self._stacks[key]

    @property
    def stacks(self) -> int:
        """Distinct stacks held."""
        return len(self._stacks)

    def last(self, n: int) -> tuple[SecondSlice, ...]:
        """The last ``n`` seconds (fewer when the ring holds fewer)."""
        return self.seconds[-n:] if n > 0 else ()


def merge(seconds: Sequence[SecondSlice], interval_ms: float, facts: dict[str, str]) -> Profile:
    """The seconds as one profile, for the writers."""
    out = Profile(interval_ms, dict(facts))
    if not seconds:
        return out
    origin = seconds[0].start
    for second in seconds:
        at = second.start - origin
        for (process, mode, stop, frames, state), cpu, count in second.counts:
            stack = Stack(frames, stop)
            sample = Sample(at, cpu, mode, mode is Mode.USER, 0, stack, process, state)
            for _ in range(count):
                out.add(sample)
    return out
