"""Every task of a guest at one moment, on a CPU or waiting, with the stacks of those waiting.

One pause (none when the guest was paused already: it stays so): the guest OS lists its tasks
(``TaskLister``) and, for each task off CPU, where its kernel stack resumes and the user
registers it entered the kernel with; the stacks are walked while the guest stands still
(each task's memory as the guest OS reads it: user pages through the task's own page
tables); frames
are named after the guest runs again. A task's stack is its kernel frames (the walk from its
saved context, cut where it crosses into user mode) then its user frames (the walk from its
saved user registers).

In a sampling run (``OffCpuTasks``) the tasks are read while the guest runs, through the control
channel, between ticks: a task's walk is kept only when its version (state and context-switch
counts) is the same before and after it and the task is on no CPU then (it stood still
meanwhile, and its stacks with it); a task whose version has not moved since the last look
keeps the stacks it had without a walk. Each tick adds the tasks of the latest look that are
not on a CPU at that tick, one sample each: a look makes each task's sample once (a task kept
keeps the very object), and the sampler files it at every tick's time by its stack's id, so a
tick costs no new objects per task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from qmpprof.capture import StackUnwinder
from qmpprof.errors import MemoryReadError
from qmpprof.guest.base import FoundTask, TaskLister
from qmpprof.model import NO_CPU, Mode, Registers, Sample, Stack, StopReason, TaskView
from qmpprof.pagecache import PAGE, PageCache, PageMissing, page_of
from qmpprof.transport.base import Forwarding, GuestTransport
from qmpprof.unwind.chain import RawStack
from qmpprof.unwind.space import AddressSpace

T = TypeVar("T")

MAX_PAGES = 64  # pages fetched for one task's walks, at most
LOOK_EVERY = 0.5  # seconds between the end of one look at every task and the next
# Ranges of a look's read sent together, at most: a tick waits for those under way before it
# stops the guest, so a long batch (a field of every task) goes out in short ones.
READS_AT_ONCE = 8


async def _now() -> None:
    """Outside a sampling run nothing holds the guest stopped."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Walked:
    found: FoundTask
    kernel: RawStack | None
    user: RawStack | None


async def every_task(
    transport: GuestTransport,
    lister: TaskLister,
    unwinder: StackUnwinder[AddressSpace, RawStack],
    boundary: int,
) -> list[TaskView]:
    """Every task of the guest in one pause; the guest is left in the run state it had.
    ``boundary``: where kernel addresses begin."""
    was_running = await transport.is_running()
    if was_running:
        await transport.stop()
    try:
        found = await lister.every_task(transport)
        walked = [await _walk(task, unwinder) for task in found]
    finally:
        if was_running:
            await transport.cont()
    return [_view(w, unwinder, boundary) for w in walked]


async def _walk(task: FoundTask, unwinder: StackUnwinder[AddressSpace, RawStack]) -> _Walked:
    cache = PageCache()
    if task.window is not None:
        cache.put_window(*task.window)
    budget = [MAX_PAGES]

    async def walk(regs: Registers | None) -> RawStack | None:
        if regs is None:
            return None
        while True:
            try:
                return unwinder.unwind(regs, cache, task.space)
            except PageMissing as missing:
                page = page_of(missing.addr)
                budget[0] -= 1
                if task.read is None or budget[0] < 0:
                    cache.pages[page] = None
                    continue
                (cache.pages[page],) = await task.read([(page, PAGE)])

    return _Walked(task, await walk(task.kernel), await walk(task.user))


def _view(
    walked: _Walked, unwinder: StackUnwinder[AddressSpace, RawStack], boundary: int
) -> TaskView:
    """After the guest runs again: the frames named."""
    found = walked.found
    stack = None
    if walked.kernel is not None:
        kernel = _kernel_part(walked.kernel, boundary)
        frames = unwinder.resolve(kernel, found.space).frames
        stop = kernel.stop
        if walked.user is not None:
            user = unwinder.resolve(walked.user, found.space)
            frames, stop = frames + user.frames, user.stop
        stack = Stack(frames, stop)
    return TaskView(found.process, found.state, found.state_name, found.cpu, stack)


def _kernel_part(raw: RawStack, boundary: int) -> RawStack:
    """The kernel frames of a walk that went on into user mode (the user frames come from the
    saved user registers instead)."""
    walked = len(raw.pcs) - 1 if raw.outer_kernel else len(raw.pcs)  # the last is kernel's
    n = next((i for i, pc in enumerate(raw.pcs[:walked]) if pc < boundary), len(raw.pcs))
    if n == len(raw.pcs):
        return raw
    return RawStack(raw.pcs[:n], StopReason.END, raw.exact[:n], raw.via[:n])


class OffCpuTasks:
    """The guest's tasks off CPU, as the latest look found them (``look``, while the guest
    runs, through ``control``), for the ticks of a sampling run (``samples``)."""

    def __init__(
        self,
        control: GuestTransport,
        lister: TaskLister,
        unwinder: StackUnwinder[AddressSpace, RawStack],
        boundary: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        every: float = LOOK_EVERY,
    ) -> None:
        self.control = control
        self.lister = lister
        self.unwinder = unwinder
        self.boundary = boundary
        self.clock = clock
        self.every = every
        self.tasks: tuple[TaskView, ...] = ()  # off CPU and verified, with their stacks
        self.looks = 0
        self.walks = 0  # tasks walked (their version had moved, or they were new)
        self.rejected = 0  # walks dropped: the task ran meanwhile
        self.prepared: tuple[Sample, ...] = ()  # per task of ``tasks`` with a stack, at time 0
        self._kept: dict[int, tuple[tuple[int, ...], TaskView, Sample | None]] = {}  # at ->
        self._last: float | None = None
        self._reads = _InFlight()

    async def quiet(self) -> None:
        """Return when none of a look's reads is under way (called once the sampler holds
        the looks back: none starts then): QEMU answers one monitor command at a time, so a
        stop sent behind a read would wait for it, the guest running meanwhile, and the pause
        would count that wait."""
        await self._reads.none()

    async def look(self, running: Callable[[], Awaitable[object]] = _now) -> None:
        """Every task read again, unless the last look ended less than ``every`` ago; those
        whose version moved walked and verified. ``running`` waits while the sampler holds
        the guest stopped: awaited before each piece of work, none of it runs in a pause.
        Whole at each await: ``tasks`` changes at the end only."""
        if self._last is not None and self.clock() - self._last < self.every:
            return
        control = _ReadsBetweenPauses(self.control, running, self._reads)
        await running()
        found = [task for task in await self.lister.every_task(control) if task.cpu is None]
        kept: dict[int, tuple[tuple[int, ...], TaskView, Sample | None]] = {}
        walked: list[_Walked] = []
        for task in found:
            before = self._kept.get(task.at)
            if before is not None and before[0] == task.version:
                # kept even when its stack did not read this time (arm64: every vCPU at EL0
                # then, its vmalloc'd stack mapped in none)
                kept[task.at] = before
            elif task.kernel is not None:
                await running()
                walked.append(await _walk(task, self.unwinder))
        await running()
        after = await self.lister.versions(control, [w.found for w in walked])
        for walk, version in zip(walked, after, strict=True):
            if version != walk.found.version:
                self.rejected += 1
                continue
            await running()
            view = _view(walk, self.unwinder, self.boundary)
            kept[walk.found.at] = (version, view, _prepared(view))
        self.walks += len(walked)
        self.looks += 1
        self._kept = kept
        self.tasks = tuple(view for _, view, _ in kept.values())
        self.prepared = tuple(sample for _, _, sample in kept.values() if sample is not None)
        self._last = self.clock()

    def samples(self, on_cpu: Sequence[Sample]) -> list[Sample]:
        """A tick's off-CPU samples: every task of the latest look but those the tick found on
        a vCPU (``on_cpu``, its samples); the same objects at every tick, their time 0 (the
        sampler files them at the tick's)."""
        running = {s.process.tid for s in on_cpu if s.process is not None}
        if not running:
            return list(self.prepared)
        return [s for s in self.prepared if s.process is None or s.process.tid not in running]


def _prepared(view: TaskView) -> Sample | None:
    if view.stack is None:
        return None
    return Sample(0.0, NO_CPU, Mode.KERNEL, False, 0, view.stack, view.process, view.state)


class _InFlight:
    """How many reads are under way, and a wait for none."""

    def __init__(self) -> None:
        self.count = 0
        self._none = asyncio.Event()
        self._none.set()

    def begin(self) -> None:
        self.count += 1
        self._none.clear()

    def end(self) -> None:
        self.count -= 1
        if not self.count:
            self._none.set()

    async def none(self) -> None:
        while self.count:  # another read may have begun before this waiter woke
            await self._none.wait()


class _ReadsBetweenPauses(Forwarding):
    """A control channel whose reads wait while the sampler holds the guest stopped: a look's
    read never goes out in a pause, and the sampler waits for one under way (``reads``) before
    it stops the guest. The rest is the control channel's."""

    def __init__(
        self, control: GuestTransport, running: Callable[[], Awaitable[object]], reads: _InFlight
    ) -> None:
        super().__init__(control)
        self._running = running
        self._reads = reads

    async def _read(self, work: Callable[[], Awaitable[T]]) -> T:
        await self._running()
        self._reads.begin()
        try:
            return await work()
        finally:
            self._reads.end()

    async def registers(self, cpu: int) -> Registers:
        return await self._read(lambda: self.inner.registers(cpu))

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        return await self._read(lambda: self.inner.system_registers(cpu, names))

    async def read(self, cpu: int, addr: int, size: int) -> bytes:
        return await self._read(lambda: self.inner.read(cpu, addr, size))

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        out: list[bytes | MemoryReadError] = []
        for i in range(0, len(ranges), READS_AT_ONCE):
            out += await self._read(
                functools.partial(self.inner.read_many, cpu, ranges[i : i + READS_AT_ONCE])
            )
        return out

    async def read_physical(
        self, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        return await self._read(functools.partial(self.inner.read_physical, ranges))

    async def translate(self, cpu: int, addr: int) -> int | None:
        return await self._read(lambda: self.inner.translate(cpu, addr))

    @property
    def control(self) -> GuestTransport | None:
        return self
