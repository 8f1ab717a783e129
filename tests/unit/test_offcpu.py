"""qmpprof.offcpu.OffCpuTasks, on a scripted guest OS: a walk is kept only when the task's version
is the same after it, a task whose version stands is not walked again, and a tick adds every
task the latest look kept but those on a vCPU at that tick."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from qmpprof.errors import MemoryReadError
from qmpprof.guest.base import FoundTask
from qmpprof.model import NO_CPU, Frame, Mode, Process, Registers, Sample, Stack, StopReason
from qmpprof.offcpu import OffCpuTasks
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.chain import RawStack
from qmpprof.unwind.space import AddressSpace

K = 0xFFFF_FFFF_8100_0000
SPACE = AddressSpace(())


class Unwinder:
    """One frame: the pc the task resumes at."""

    kernel_boundary = 1 << 63

    def __init__(self) -> None:
        self.walked: list[int] = []

    def unwind(self, regs: Registers, cache: PageCache, space: AddressSpace) -> RawStack:
        self.walked.append(regs.pc)
        return RawStack((regs.pc,), StopReason.END, (True,))

    def resolve(self, raw: RawStack, space: AddressSpace) -> Stack:
        return Stack(tuple(Frame(pc, True, f"f{pc - K}") for pc in raw.pcs), raw.stop)


class Lister:
    """Tasks by tid: (state, where it resumes, version now, version after the walk)."""

    def __init__(self) -> None:
        self.tasks: dict[int, tuple[str, int, int, int]] = {}
        self.on_cpu: set[int] = set()

    async def every_task(self, transport: GuestTransport) -> Sequence[FoundTask]:
        return [
            FoundTask(
                Process(tid, f"p{tid}", 0, tid),
                state,
                state,
                0 if tid in self.on_cpu else None,
                SPACE,
                kernel=Registers(0, "x86_64", K + pc, 0, 0, False, 0),
                at=tid,
                version=(now,),
            )
            for tid, (state, pc, now, _) in self.tasks.items()
        ]

    async def versions(
        self, transport: GuestTransport, tasks: Sequence[FoundTask]
    ) -> list[tuple[int, ...] | None]:
        return [(self.tasks[t.at][3],) for t in tasks]


def waiting(lister: Lister, unwinder: Unwinder, clock: list[float]) -> OffCpuTasks:
    control: GuestTransport = None  # type: ignore[assignment]  # the fake lister reads nothing
    return OffCpuTasks(control, lister, unwinder, 1 << 63, clock=lambda: clock[0], every=0.2)


def leaves(samples: Sequence[Sample]) -> dict[int | None, tuple[str | None, str | None]]:
    return {
        s.process.tid if s.process else None: (s.state, s.stack.frames[0].symbol) for s in samples
    }


async def test_a_walk_is_kept_only_when_the_task_stood_still() -> None:
    lister, unwinder, clock = Lister(), Unwinder(), [0.0]
    lister.tasks = {10: ("S", 1, 5, 5), 11: ("D", 2, 7, 8), 12: ("R", 3, 1, 1)}
    lister.on_cpu = {12}
    off = waiting(lister, unwinder, clock)
    await off.look()
    assert leaves(off.samples([])) == {10: ("S", "f1")}  # 11 ran meanwhile; 12 is on a CPU
    assert (off.walks, off.rejected) == (2, 1)
    # Too soon: no look. Then 10 has not moved (no walk), 11 has stood still this time.
    lister.tasks[11] = ("D", 4, 8, 8)
    clock[0] = 0.1
    await off.look()
    assert off.looks == 1
    clock[0] = 0.5
    unwinder.walked.clear()
    await off.look()
    assert unwinder.walked == [K + 4]
    assert leaves(off.samples([])) == {10: ("S", "f1"), 11: ("D", "f4")}
    # 10 woke up and slept again elsewhere: walked again, its new stack kept.
    lister.tasks[10] = ("S", 9, 6, 6)
    clock[0] = 1.0
    await off.look()
    assert leaves(off.samples([]))[10] == ("S", "f9")


async def test_a_tick_leaves_out_the_tasks_it_found_on_a_vcpu() -> None:
    lister, clock = Lister(), [0.0]
    lister.tasks = {10: ("S", 1, 5, 5), 11: ("R", 2, 7, 7)}
    off = waiting(lister, Unwinder(), clock)
    await off.look()
    on_vcpu = Sample(
        4.0, 1, Mode.USER, True, 0, Stack((), StopReason.END), Process(11, "p11", 0, 11)
    )
    found = off.samples([on_vcpu])
    assert [(s.process.tid if s.process else None, s.cpu, s.mode) for s in found] == [
        (10, NO_CPU, Mode.KERNEL)
    ]


async def test_a_task_that_stood_still_keeps_its_very_sample_from_look_to_look() -> None:
    lister, clock = Lister(), [0.0]
    lister.tasks = {10: ("S", 1, 5, 5), 11: ("S", 2, 7, 7)}
    off = waiting(lister, Unwinder(), clock)
    await off.look()
    first = {s.process.tid if s.process else None: s for s in off.samples([])}
    lister.tasks[11] = ("S", 3, 8, 8)  # 11 ran and slept again: a new walk, a new sample
    clock[0] = 1.0
    await off.look()
    again = {s.process.tid if s.process else None: s for s in off.samples([])}
    assert again[10] is first[10] and again[11] is not first[11]
    assert again[11].stack.frames[0].symbol == "f3"


class Control:
    """A control channel that records its reads."""

    def __init__(self) -> None:
        self.reads = 0

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        self.reads += 1
        return [bytes(size) for _, size in ranges]


class ReadingLister(Lister):
    """Reads through the transport it is given, as a guest OS does; a pause begins right
    before its read (``running`` cleared)."""

    def __init__(self, running: asyncio.Event) -> None:
        super().__init__()
        self.running = running

    async def every_task(self, transport: GuestTransport) -> Sequence[FoundTask]:
        self.running.clear()
        await transport.read_many(0, [(0x1000, 8)])
        return await super().every_task(transport)


async def test_a_look_reads_nothing_while_the_guest_is_held_stopped() -> None:
    running = asyncio.Event()
    running.set()
    control, lister = Control(), ReadingLister(running)
    lister.tasks = {10: ("S", 1, 5, 5)}
    transport: GuestTransport = control  # type: ignore[assignment]  # reads are all it needs
    off = OffCpuTasks(transport, lister, Unwinder(), 1 << 63)
    look = asyncio.ensure_future(off.look(running.wait))
    for _ in range(5):
        await asyncio.sleep(0)
    assert control.reads == 0 and not look.done()
    running.set()
    await look
    assert control.reads == 1 and [t.state for t in off.tasks] == ["S"]


class SlowControl(Control):
    """A read that QEMU answers only when ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        await self.answer.wait()
        return await super().read_many(cpu, ranges)


class FirstReadingLister(Lister):
    """Reads through the transport it is given before it lists, as a guest OS does."""

    async def every_task(self, transport: GuestTransport) -> Sequence[FoundTask]:
        await transport.read_many(0, [(0x1000, 8)])
        return await super().every_task(transport)


async def test_the_sampler_can_wait_for_a_look_s_read_under_way_before_it_stops() -> None:
    control, lister = SlowControl(), FirstReadingLister()
    lister.tasks = {10: ("S", 1, 5, 5)}
    transport: GuestTransport = control  # type: ignore[assignment]  # reads are all it needs
    off = OffCpuTasks(transport, lister, Unwinder(), 1 << 63)
    await off.quiet()  # nothing under way: at once
    look = asyncio.ensure_future(off.look())
    quiet = asyncio.ensure_future(off.quiet())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not quiet.done() and control.reads == 0  # the read is under way in QEMU
    control.answer.set()
    await quiet
    assert control.reads == 1
    await look
    assert [t.state for t in off.tasks] == ["S"]
