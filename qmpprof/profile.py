"""What a run collected: samples as frames (data, not names), counted, plus the run's facts.

Identical frames and identical stacks are stored once (interned); each sample costs an entry
in three flat arrays (time, vCPU, stack id: 14 bytes), which keep the time order speedscope's
time view needs. Names are made only when a profile is written (``naming.py``), so one profile
can be rendered in every naming mode and every format. Pure data and pure transforms only.
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from qmpprof.model import NO_CPU, Frame, Mode, Process, Sample, Stack, StopReason
from qmpprof.naming import Naming, stack_names


@dataclass(frozen=True, slots=True)
class StackRecord:
    """One distinct stack: who ran it, in which mode, its frames (ids, leaf first), how its
    walk ended."""

    process: Process | None
    mode: Mode
    stop: StopReason
    frames: tuple[int, ...]
    state: str | None = None  # off CPU: the task's state letter

    @property
    def truncated(self) -> bool:
        return not self.stop.whole


@dataclass(frozen=True, slots=True)
class NamedStack:
    names: tuple[str, ...]  # root first
    kernel: tuple[bool, ...]  # per name: kernel code (for colouring)


@dataclass(slots=True)
class Profile:
    """Everything a run collected. ``facts`` are shown in titles and summaries (ordered)."""

    interval_ms: float = 10.0
    facts: dict[str, str] = field(default_factory=dict)
    frames: list[Frame] = field(default_factory=list)
    stacks: list[StackRecord] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # samples per stack id
    times: array[float] = field(default_factory=lambda: array("d"))  # seconds since the start
    cpus_of: array[int] = field(default_factory=lambda: array("H"))
    stack_of: array[int] = field(default_factory=lambda: array("I"))
    _frame_ids: dict[Frame, int] = field(default_factory=dict, repr=False, compare=False)
    _stack_ids: dict[tuple[object, ...], int] = field(
        default_factory=dict, repr=False, compare=False
    )

    def add(self, sample: Sample) -> None:
        self.add_at(sample.time, sample.cpu, self.stack_id(sample))

    def stack_id(self, sample: Sample) -> int:
        """The id of the sample's stack (who, mode, frames, how the walk ended, state), stored
        once; no sample is counted."""
        stack = sample.stack
        key = (sample.process, sample.mode, stack.stop, stack.frames, sample.state)
        sid = self._stack_ids.get(key)
        if sid is None:
            sid = self._intern(sample.process, sample.mode, stack.stop, stack.frames, sample.state)
            self._stack_ids[key] = sid
        return sid

    def add_at(self, time: float, cpu: int, sid: int, count: int = 1, step: float = 0.0) -> None:
        """A sample of the stack ``sid`` (from ``stack_id``) at ``time`` on ``cpu``; or
        ``count`` of them, ``step`` seconds apart (a pprof's counts, added at C speed)."""
        if not 0 <= cpu <= NO_CPU:
            raise ValueError(f"vCPU {cpu}")
        self.counts[sid] += count
        if count == 1:
            self.times.append(time)
            self.cpus_of.append(cpu)
            self.stack_of.append(sid)
            return
        self.times.extend(map(time.__add__, map(step.__mul__, range(count))))
        self.cpus_of.extend(array("H", (cpu,)) * count)
        self.stack_of.extend(array("I", (sid,)) * count)

    def _intern(
        self,
        process: Process | None,
        mode: Mode,
        stop: StopReason,
        frames: tuple[Frame, ...],
        state: str | None,
    ) -> int:
        ids = []
        for frame in frames:
            fid = self._frame_ids.get(frame)
            if fid is None:
                fid = self._frame_ids[frame] = len(self.frames)
                self.frames.append(frame)
            ids.append(fid)
        self.stacks.append(StackRecord(process, mode, stop, tuple(ids), state))
        self.counts.append(0)
        return len(self.stacks) - 1

    def __len__(self) -> int:
        """The number of samples."""
        return len(self.times)

    @property
    def truncated(self) -> int:
        return sum(c for s, c in zip(self.stacks, self.counts, strict=True) if s.truncated)

    @property
    def cpus(self) -> list[int]:
        return sorted(set(self.cpus_of) - {NO_CPU})

    def frames_of(self, record: StackRecord) -> list[Frame]:
        return [self.frames[i] for i in record.frames]

    def named(self, naming: Naming) -> list[NamedStack]:
        """Per stack id, its names root first."""
        return [
            NamedStack(*stack_names(s.process, self.frames_of(s), s.stop, naming, s.state))
            for s in self.stacks
        ]

    def named_counts(self, naming: Naming) -> Counter[tuple[str, ...]]:
        """Samples per distinct named stack, root first (stacks that differ only in what the
        naming does not show, an offset say, are one)."""
        out: Counter[tuple[str, ...]] = Counter()
        for named, count in zip(self.named(naming), self.counts, strict=True):
            if count:
                out[named.names] += count
        return out

    def timeline(self) -> Iterator[tuple[float, int, int]]:
        """(time, vCPU, stack id) per sample, in the order they were added."""
        return zip(self.times, self.cpus_of, self.stack_of, strict=True)

    def top_functions(self, naming: Naming, n: int = 10) -> list[tuple[str, int]]:
        """Self samples per leaf frame name, most first."""
        leaves: Counter[str] = Counter()
        for names, count in self.named_counts(naming).items():
            leaves[names[-1]] += count
        return sorted(leaves.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

    def select(
        self,
        keep: Mode | None = None,
        cpus: Sequence[int] | None = None,
        on_cpu: bool | None = None,
        since: float | None = None,
        where: Callable[[int], bool] | None = None,
    ) -> Profile:
        """The samples of one mode (kernel mode: only their kernel frames), of some vCPUs, on a
        CPU only (``on_cpu`` True) or off (False), taken at ``since`` or later, of the stack ids
        ``where`` accepts."""
        out = Profile(self.interval_ms, dict(self.facts))
        wanted = None if cpus is None else set(cpus)
        first = 0 if since is None else bisect.bisect_left(self.times, since)
        tail = zip(self.times[first:], self.cpus_of[first:], self.stack_of[first:], strict=True)
        for time, cpu, sid in tail:
            record = self.stacks[sid]
            if keep is not None and record.mode is not keep:
                continue
            if wanted is not None and cpu not in wanted:
                continue
            if on_cpu is not None and on_cpu != (record.state is None):
                continue
            if where is not None and not where(sid):
                continue
            frames = self.frames_of(record)
            if keep is Mode.KERNEL:
                frames = [f for f in frames if f.kernel]
            stack = Stack(tuple(frames), record.stop)
            user = record.mode is Mode.USER
            out.add(Sample(time, cpu, record.mode, user, 0, stack, record.process, record.state))
        return out

    def forget_before(self, time: float) -> None:
        """Drop the samples taken before ``time`` (a live view keeps only its window); their
        stacks stay interned, uncounted."""
        first = bisect.bisect_left(self.times, time)
        for sid in self.stack_of[:first]:
            self.counts[sid] -= 1
        del self.times[:first], self.cpus_of[:first], self.stack_of[:first]


def share_margin(samples: int) -> float:
    """The 95 % margin, in percentage points, of a share estimated from ``samples`` samples,
    taken near one half where it is widest (1.96 standard errors of a binomial proportion). No
    samples: a share could be anything, 100 points."""
    return 196 * (0.25 / samples) ** 0.5 if samples > 0 else 100.0
