"""The sampler over a scripted fake transport: tick structure, timing policy (by counting calls
on a virtual clock), run-state safety, errors as data, filtering, page refetching, stats."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import pytest
from fakes import (
    FakeClock,
    FakeSpace,
    FakeTransport,
    FramePointerUnwinder,
    KernelIdentifier,
    RawStack,
    frame_chain,
    regs,
)

from qmpprof.arch.x86 import X86_64
from qmpprof.errors import GuestGoneError, GuestHeldError, TransportError, UsageError
from qmpprof.memory import ALIGN, PIECE, SLACK
from qmpprof.model import NO_CPU, Frame, Mode, Process, Registers, Sample, Stack, StopReason
from qmpprof.naming import Naming
from qmpprof.pagecache import PageCache, PageMissing
from qmpprof.sampler import LEAD, WARM_AFTER, Sampler, SamplerConfig
from qmpprof.stats import SamplerStats

K = X86_64.kernel_boundary
SPACE = FakeSpace(
    (
        (0x40_1000, 0x40_1100, "user_main"),
        (K + 0x1000, K + 0x1100, "kmain"),
        (K + 0x2000, K + 0x2100, "schedule"),
        (K + 0x3000, K + 0x3100, "idle_loop"),
    )
)
STACK_TOP = K + 0x20_0000


def kernel_cpu(cpu: int = 0) -> tuple[Registers, dict[int, bytes]]:
    rbp, pages = frame_chain(STACK_TOP, [K + 0x2010, K + 0x1010])
    return regs(cpu, K + 0x3004, rsp=rbp - 32, rbp=rbp), pages


def make(
    transport: FakeTransport,
    unwinder: FramePointerUnwinder | None = None,
    identifier: KernelIdentifier[FakeSpace] | None = None,
    housekeeping: Callable[[], Awaitable[None]] | None = None,
    **config: object,
) -> Sampler[FakeSpace, tuple[tuple[int, ...], StopReason]]:
    return Sampler(
        transport,
        unwinder or FramePointerUnwinder(),
        identifier or KernelIdentifier(SPACE),
        SamplerConfig(**config),  # type: ignore[arg-type]
        clock=transport.clock,
        sleep=transport.clock.sleep,
        rng=lambda: 0.5,
        housekeeping=housekeeping,
    )


async def test_every_tick_stops_once_samples_every_cpu_and_resumes() -> None:
    r0, pages = kernel_cpu(0)
    r1 = regs(1, K + 0x3008, rsp=r0.sp, rbp=r0.fp)
    transport = FakeTransport({0: r0, 1: r1}, pages)
    sampler = make(transport, duration=0.03, interval=0.01)
    outcome = await sampler.run()
    assert transport.calls.count("stop") == 3
    assert transport.calls.count("cont") == 3
    assert transport.calls[-1] == "cont"
    first_tick = transport.calls[transport.calls.index("stop") : transport.calls.index("cont") + 1]
    assert first_tick[:3] == ["stop", "registers:0", "registers:1"]
    assert len(sampler.profile) == 6 and sampler.stats.ticks == 3
    assert [s.cpu for s in outcome.last] == [0, 1]
    assert (
        sampler.profile.named_counts(Naming())[
            ("kernel", "kmain_[k]", "schedule_[k]", "idle_loop_[k]")
        ]
        == 6
    )


async def test_interval_is_guest_run_time_not_wall_clock_slots() -> None:
    r0, pages = kernel_cpu()
    clock = FakeClock()
    # A slow pause (4 ms) and slow post-processing after cont (3 ms).
    transport = FakeTransport({0: r0}, pages, clock=clock, costs={"stop": 0.004})

    def slow_symbolize() -> None:
        clock.now += 0.003

    sampler = make(transport, FramePointerUnwinder(on_resolve=slow_symbolize), duration=0.05)
    await sampler.run()
    # The first wait is a full interval; later ones only subtract what ran after cont.
    assert clock.sleeps[0] == pytest.approx(0.010)
    assert clock.sleeps[1:] == pytest.approx([0.007] * 4)
    assert sampler.stats.ticks == 5
    assert sampler.stats.run_time == pytest.approx(0.05)
    assert sampler.stats.pause_ms()[0] == pytest.approx(4.0)
    assert sampler.stats.rate_hz() == pytest.approx(100.0)


async def test_a_late_tick_makes_the_next_one_sooner() -> None:
    """Sleeps that wake 1.5 ms late (a loaded host, asyncio's wake-up): each next wait is that
    much shorter, so 50 ms of run time still hold 5 ticks, the rate asked; the debt is at most
    one interval (a 30 ms stall is not made up by a burst)."""
    r0, pages = kernel_cpu()
    clock = FakeClock()
    transport = FakeTransport({0: r0}, pages, clock=clock)

    async def late_sleep(seconds: float) -> None:
        await clock.sleep(seconds + 0.0015)

    sampler = Sampler(
        transport, FramePointerUnwinder(), KernelIdentifier(SPACE),
        SamplerConfig(interval=0.01, duration=0.05), clock=clock, sleep=late_sleep,
    )  # fmt: skip
    await sampler.run()
    assert clock.sleeps == pytest.approx([0.0115, 0.010, 0.010, 0.010, 0.010])  # (as slept)
    assert sampler.stats.run_time == pytest.approx(0.05 + 0.0015)
    assert sampler.stats.rate_hz() == pytest.approx(5 / 0.0515)
    stalled = FakeClock()

    async def one_stall(seconds: float) -> None:
        await stalled.sleep(seconds + (0.030 if not stalled.sleeps else 0.0))

    again = Sampler(
        FakeTransport({0: r0}, pages, clock=stalled), FramePointerUnwinder(),
        KernelIdentifier(SPACE), SamplerConfig(interval=0.01, duration=0.05),
        clock=stalled, sleep=one_stall,
    )  # fmt: skip
    await again.run()
    assert stalled.sleeps == pytest.approx([0.040, 0.0, 0.010, 0.010, 0.010])


async def test_jitter_scales_each_interval() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    sampler = Sampler(
        transport,
        FramePointerUnwinder(),
        KernelIdentifier(SPACE),
        SamplerConfig(duration=0.03, jitter=0.5),
        clock=transport.clock,
        sleep=transport.clock.sleep,
        rng=iter([0.0, 1.0, 0.5]).__next__,
    )
    await sampler.run()
    assert transport.clock.sleeps == pytest.approx([0.005, 0.015, 0.010])


async def test_paused_guest_is_sampled_once_without_stop_or_cont() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages, running=False)
    outcome = await make(transport).run()
    assert "stop" not in transport.calls and "cont" not in transport.calls
    assert not outcome.was_running
    assert [f.symbol for f in outcome.last[0].stack.frames] == ["idle_loop", "schedule", "kmain"]


async def test_one_shot_on_running_guest_stops_and_resumes_once() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    outcome = await make(transport).run(one_shot=True)
    assert (transport.calls.count("stop"), transport.calls.count("cont")) == (1, 1)
    assert outcome.was_running and len(outcome.last) == 1


class Bug(Exception):
    pass


async def test_guest_resumed_when_an_exception_escapes_while_stopped() -> None:
    r0, pages = kernel_cpu()

    def hook(name: str, stops: int) -> None:
        if name == "registers:0" and stops == 2:
            raise Bug

    transport = FakeTransport({0: r0}, pages, hook=hook)
    sampler = make(transport)
    with pytest.raises(Bug):
        await sampler.run()
    assert transport.calls[-1] == "cont" and transport.running
    assert len(sampler.profile) == 1


async def test_guest_resumed_when_cancelled_while_stopped() -> None:
    r0, pages = kernel_cpu()
    blocked = asyncio.Event()

    class Blocking(FakeTransport):
        async def read(self, cpu: int, addr: int, size: int) -> bytes:
            blocked.set()
            await asyncio.Event().wait()  # never answers
            raise AssertionError

    transport = Blocking({0: r0}, pages)
    task = asyncio.create_task(make(transport).run())
    await blocked.wait()
    assert not transport.running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert transport.calls[-1] == "cont" and transport.running


async def test_qemu_gone_keeps_what_was_collected() -> None:
    r0, pages = kernel_cpu()

    def hook(name: str, stops: int) -> None:
        if name == "stop" and stops == 3:
            raise GuestGoneError("QEMU closed the QMP connection")

    transport = FakeTransport({0: r0}, pages, hook=hook)
    sampler = make(transport)
    with pytest.raises(GuestGoneError):
        await sampler.run()
    assert len(sampler.profile) == 3
    assert sum(sampler.profile.named_counts(Naming()).values()) == 3


async def test_a_guest_something_else_stopped_ends_the_run_and_stays_stopped() -> None:
    r0, pages = kernel_cpu()

    def hook(name: str, stops: int) -> None:
        if name == "stop" and stops == 3:
            transport.running = False  # as another QMP client's stop left it
            raise GuestHeldError("paused")

    transport = FakeTransport({0: r0}, pages, hook=hook)
    sampler = make(transport)
    with pytest.raises(GuestHeldError, match=r"\(QEMU says paused\): the run ends here"):
        await sampler.run()
    assert transport.calls.count("cont") == 3 and transport.calls[-1] == "stop"
    assert not transport.running
    assert len(sampler.profile) == 3


async def test_errors_in_one_sample_are_counted_and_the_run_goes_on() -> None:
    r0, pages = kernel_cpu(0)

    def hook(name: str, stops: int) -> None:
        if name == "registers:1":
            raise TransportError("no registers for vCPU 1")
        if name.startswith("read") and stops == 2:
            raise RuntimeError("reader bug")

    transport = FakeTransport({0: r0, 1: r0}, pages, hook=hook)
    sampler = make(transport, duration=0.03)
    await sampler.run()
    assert sampler.stats.ticks == 3
    assert len(sampler.profile) == 2
    assert sampler.stats.errors["registers: no registers for vCPU 1"] == 3
    assert sampler.stats.errors["RuntimeError: reader bug"] == 1
    assert sampler.stats.error_count == 4


@pytest.mark.parametrize(
    ("keep", "kept_mode", "filtered"), [(Mode.KERNEL, Mode.KERNEL, 2), (Mode.USER, Mode.USER, 2)]
)
async def test_mode_filter_counts_filtered_apart_from_errors(
    keep: Mode, kept_mode: Mode, filtered: int
) -> None:
    # The kernel vCPU's chain ends in a user frame (a system call): --kernel-only drops it.
    rbp, pages = frame_chain(STACK_TOP, [K + 0x2010, 0x40_1010])
    kernel = regs(0, K + 0x3004, rsp=rbp, rbp=rbp)
    user = regs(1, 0x40_1020, rsp=0, rbp=0)
    transport = FakeTransport({0: kernel, 1: user}, pages)
    sampler = make(transport, duration=0.02, keep=keep)
    await sampler.run()
    assert sampler.stats.filtered == filtered
    assert len(sampler.profile) == 2 and sampler.stats.error_count == 0
    stacks = set(sampler.profile.named_counts(Naming()))
    if kept_mode is Mode.KERNEL:
        assert stacks == {("kernel", "schedule_[k]", "idle_loop_[k]")}
    else:
        assert stacks == {("kernel", "user_main")}
        # The filtered kernel vCPU's stack is never read, only the user one's (from 0, its
        # first window page by page).
        reads = {c for c in transport.calls if c.startswith("read")}
        assert reads and all(int(c[5:].split("+")[0], 16) < 0x4000 for c in reads)


async def test_pages_the_unwinder_misses_are_fetched_while_stopped() -> None:
    rbp, pages = frame_chain(STACK_TOP, [K + 0x2010, K + 0x1010], gap=0x1800)
    r0 = regs(0, K + 0x3004, rsp=rbp, rbp=rbp)
    transport = FakeTransport({0: r0}, pages)
    unwinder = FramePointerUnwinder()
    sampler = make(transport, unwinder, window=4096)
    outcome = await sampler.run(one_shot=True)
    assert outcome.last[0].stack.stop is StopReason.END
    assert unwinder.unwinds > 1
    reads = [c for c in transport.calls if c.startswith("read")]
    # The first window page by page (RSP is mid-page: two reads, one request), then one read
    # for each walk that asked for more.
    assert len(reads) == 2 + unwinder.unwinds - 1
    assert transport.calls.index("cont") > transport.calls.index(reads[-1])


async def test_refetch_budget_bounds_reads_and_truncates() -> None:
    rbp, pages = frame_chain(STACK_TOP, [K + 0x2010, K + 0x1010], gap=0x1800)
    r0 = regs(0, K + 0x3004, rsp=rbp, rbp=rbp)
    transport = FakeTransport({0: r0}, pages)
    sampler = make(transport, window=4096, max_refetch=0)
    outcome = await sampler.run(one_shot=True)
    assert outcome.last[0].stack.stop is StopReason.READ_FAILED
    assert sampler.profile.truncated == 1
    # The first window (page by page, in one request: two reads), and nothing on demand.
    assert sum(c.startswith("read") for c in transport.calls) == 2
    assert sampler.profile.named_counts(Naming()) == {
        ("kernel", "[truncated]", "schedule_[k]", "idle_loop_[k]"): 1
    }


async def test_window_over_the_stack_top_is_read_once_page_by_page_then_cut() -> None:
    r0, pages = kernel_cpu()  # RSP's page is the last mapped one
    transport = FakeTransport({0: r0}, pages)
    sampler = make(transport, window=64 * 1024, duration=0.03)
    await sampler.run()
    reads = [c for c in transport.calls if c.startswith("read")]
    rsp_page = r0.sp & ~0xFFF
    # One request, page by page: the pages above the stack fail alone, RSP's page is read.
    first = by_page(r0.sp, rsp_page + 0x11000)
    assert reads[: len(first)] == first and len(first) == 17
    # Later ticks know where the stack ends: one read each, from RSP to there.
    assert reads[len(first) :] == [f"read:{r0.sp:#x}+{rsp_page + 0x1000 - r0.sp:#x}"] * 2
    assert len(sampler.profile) == 3 and sampler.profile.truncated == 0


async def test_a_failed_read_that_says_how_far_it_got_is_not_read_again() -> None:
    # Two stack pages: the leaf's frame on RSP's page, the outer one on the page above.
    rbp, pages = frame_chain(STACK_TOP, [K + 0x2010, K + 0x1010], gap=0x800)
    r0 = regs(0, K + 0x3004, rsp=rbp - 32, rbp=rbp)
    rsp_page = r0.sp & ~0xFFF
    assert len(pages) == 2 and rsp_page + 0x1000 in pages
    transport = FakeTransport({0: r0}, pages, partial=True)
    sampler = make(transport, window=16 * 1024, duration=0.02)
    await sampler.run()  # learns the window: from RSP to the top of the stack, one read
    transport.calls.clear()
    del transport.pages[rsp_page + 0x1000]  # the upper page is gone (the mapping changed)
    again = make(transport, window=16 * 1024, duration=0.02)
    again.capture.stacks = sampler.capture.stacks
    await again.run()
    reads = [c for c in transport.calls if c.startswith("read")]
    # The window fails past RSP's page but says how far it read: no second pass page by
    # page. The next tick knows the stack ends there (and its walk tries the page above
    # once, on demand: unmapped).
    window = f"read:{r0.sp:#x}+{STACK_TOP - 0x800 + SLACK - r0.sp:#x}"
    cut = f"read:{r0.sp:#x}+{rsp_page + 0x1000 - r0.sp:#x}"
    assert reads == [window, cut, f"read:{rsp_page + 0x1000:#x}+0x1000"], reads
    assert again.profile.truncated == 2


async def test_the_window_is_cut_to_the_bytes_walks_needed_and_grows_on_demand() -> None:
    r0, pages = kernel_cpu()
    rsp_page = r0.sp & ~0xFFF
    above = {rsp_page + i * 0x1000: bytes(0x1000) for i in range(1, 16)}  # mapped, unused
    transport = FakeTransport({0: r0}, {**above, **pages})
    sampler = make(transport, window=16 * 1024, duration=0.02)
    await sampler.run()
    reads = [c for c in transport.calls if c.startswith("read")]
    # The first tick reads the whole window from RSP (mid-page: to five pages above its page);
    # the walk read up to the top of RSP's page (the outermost frame's return address): the
    # next window ends SLACK bytes above that.
    top = rsp_page + 0x1000
    first = by_page(r0.sp, rsp_page + 0x5000)
    assert reads == [*first, f"read:{r0.sp:#x}+{top + SLACK - r0.sp:#x}"]
    # A deeper walk from the same RSP page fetches what it lacks, and the window grows to it.
    rbp, deeper = frame_chain(rsp_page + 0x4000, [K + 0x2010, K + 0x1010], gap=0x1800)
    transport.pages.update(deeper)
    transport._regs = {0: regs(0, K + 0x3004, rsp=r0.sp, rbp=rbp)}
    for expected_reads in (2, 1):  # on demand once, then within the window
        transport.calls.clear()
        again = make(transport, window=16 * 1024)
        again.capture.stacks = sampler.capture.stacks
        outcome = await again.run(one_shot=True)
        assert outcome.last[0].stack.stop is StopReason.END
        reads = [c for c in transport.calls if c.startswith("read")]
        assert len(reads) >= expected_reads and reads[0].startswith(f"read:{r0.sp:#x}+")
        if expected_reads == 1:
            assert len(reads) == 1 and int(reads[0].split("+")[1], 16) > 0x1000


async def test_pages_a_walk_read_beyond_the_window_come_with_the_next_window() -> None:
    # Frames 0x8010 bytes apart: from the leaf's page, the next frame is beyond a 4 KiB window's
    # reach (as the user stack is beneath a system call's kernel stack).
    rbp, pages = frame_chain(STACK_TOP, [K + 0x2010, K + 0x1010], gap=0x8000)
    r0 = regs(0, K + 0x3004, rsp=rbp, rbp=rbp)
    transport = FakeTransport({0: r0}, pages)
    unwinder = FramePointerUnwinder()
    sampler = make(transport, unwinder, window=4096, duration=0.02)
    await sampler.run()
    ticks = [c for c in transport.calls if c.startswith("read") or c == "stop"]
    outer = rbp + 0x8010  # the outermost frame: [saved rbp][return address]
    far = outer & ~0xFFF
    first, second = ticks[1 : ticks.index("stop", 1)], ticks[ticks.index("stop", 1) + 1 :]
    assert first[-1] == f"read:{far:#x}+0x1000"  # on demand, after a walk asked for it
    window = f"read:{rbp & ~(ALIGN - 1):#x}+"  # RSP (= RBP here), rounded down
    assert len(second) == 2 and first[0].startswith(window) and second[0].startswith(window)
    # Both before the walk: the window, and about one packet around the bytes read out there.
    start, size = (int(x, 16) for x in second[1].removeprefix("read:").split("+"))
    assert far <= start <= outer and outer + 16 <= start + size <= far + 0x1000
    assert size <= PIECE
    assert unwinder.unwinds == 3  # two walks in the first tick, one in the second
    assert len(sampler.profile) == 2 and sampler.profile.truncated == 0


def test_a_piece_is_read_where_pages_are_not_and_unmapped_pieces_read_as_none() -> None:
    cache = PageCache()
    cache.pieces[0x1FF8] = (16, bytes(range(16)))
    cache.pieces[0x5000] = (8, None)
    assert cache.read(0x1FFC, 8) == bytes(range(4, 12))  # across a page boundary
    assert cache.read_u64(0x5000) is None
    assert cache.has(0x1FF8, 16) and not cache.has(0x1FF8, 17)
    with pytest.raises(PageMissing):
        cache.read(0x2004, 8)  # past the piece: the page is not fetched
    assert cache.used == {0x1000: [0xFFC, 0x1000], 0x2000: [0, 4]}  # per page, what was read


def test_above_a_boundary_a_cache_keeps_only_what_it_held_there() -> None:
    # A kernel stack's window and page are kept, a user page and piece are not.
    cache = PageCache()
    cache.put_window(0xFFFF_8000_0800_0FC0, bytes(range(0x40)))
    cache.pages |= {0xFFFF_8000_0800_1000: bytes(0x1000), 0x7FFF_F000: b"\x01" * 0x1000}
    cache.pieces |= {0xFFFF_0000_0000_0010: (8, None), 0x40_1000: (8, bytes(8))}
    kept = cache.above(0xFF80_0000_0000_0000)
    assert kept.read_u64(0xFFFF_8000_0800_0FC8) == int.from_bytes(bytes(range(8, 16)), "little")
    assert set(kept.pages) == {0xFFFF_8000_0800_1000}
    assert set(kept.pieces) == {0xFFFF_0000_0000_0010}
    with pytest.raises(PageMissing):
        kept.read_u64(0x7FFF_F000)
    user = PageCache()
    user.put_window(0x7FFF_EFC0, bytes(0x40))  # a user window is not kept
    assert not user.above(0xFF80_0000_0000_0000).has(0x7FFF_EFC0, 8)


def test_the_window_serves_reads_at_any_address_and_keeps_the_highest_byte_read() -> None:
    cache = PageCache()
    cache.put_window(0x1FC0, bytes(range(0x80)))
    cache.pages[0x2000] = bytes(0x1000)
    assert cache.read_u64(0x1FC8) == int.from_bytes(bytes(range(8, 16)), "little")
    assert cache.read(0x2000, 4) == bytes(range(0x40, 0x44))  # the window, before the page
    assert cache.top == 0x2004 and not cache.used
    assert cache.read_u64(0x2100) == 0 and cache.used == {0x2000: [0x100, 0x108]}
    assert cache.has(0x1FC0, 0x80) and not cache.has(0x1F00, 8)
    with pytest.raises(PageMissing):
        cache.read(0x1FB8, 8)  # below the window: its page is not fetched


async def test_housekeeping_runs_between_ticks_while_the_guest_runs_and_its_errors_pass() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    calls: list[int] = []

    async def housekeeping() -> None:
        calls.append(len(transport.calls))
        transport.calls.append("housekeeping")
        if len(calls) == 2:
            raise TransportError("the guest's memory could not be read")

    sampler = make(transport, housekeeping=housekeeping, duration=0.03)
    await sampler.run()
    assert len(sampler.profile) == 3 and len(calls) == 3  # after every tick, the run went on
    ticks = [c for c in transport.calls if c in ("stop", "cont", "housekeeping")]
    assert ticks == ["stop", "cont", "housekeeping"] * 3  # never inside a pause
    transport.calls.clear()
    await sampler.run(one_shot=True)
    assert "housekeeping" not in transport.calls


async def test_a_long_housekeeping_job_never_holds_the_next_tick_back() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    released, finished = asyncio.Event(), []

    async def housekeeping() -> None:  # a job waiting on QEMU longer than the interval
        transport.calls.append("housekeeping")
        await released.wait()
        finished.append(len([c for c in transport.calls if c == "stop"]))

    sampler = make(transport, housekeeping=housekeeping, duration=0.05)
    sampler._on_tick = lambda stats: released.set() if stats.ticks == 4 else None
    await sampler.run()
    # Every tick came while the first job waited, and none started another meanwhile; the run
    # ended with the job done (it was let finish), not left running.
    assert [c for c in transport.calls if c in ("stop", "housekeeping")][:5] == [
        "stop", "housekeeping", "stop", "stop", "stop",
    ]  # fmt: skip
    assert transport.calls.count("stop") == 5 and finished and finished[0] >= 4


async def test_request_stop_ends_after_the_current_tick() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    sampler = make(transport, duration=10.0)
    sampler._on_tick = lambda stats: sampler.request_stop() if stats.ticks == 2 else None
    await sampler.run()
    assert sampler.stats.ticks == 2
    assert transport.calls[-1] == "cont"


async def test_a_stop_requested_while_waiting_for_the_next_tick_ends_the_wait() -> None:
    # An interval the overhead budget lengthened may be seconds long: a stop does not wait it out.
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    never = asyncio.Event()
    sampler = Sampler(
        transport,
        FramePointerUnwinder(),
        KernelIdentifier(SPACE),
        SamplerConfig(duration=3600.0, interval=600.0),
        clock=transport.clock,
        sleep=lambda seconds: never.wait(),
    )
    running = asyncio.ensure_future(sampler.run())
    for _ in range(5):
        await asyncio.sleep(0)
    sampler.request_stop()
    outcome = await asyncio.wait_for(running, 5)
    assert outcome.was_running and sampler.stats.ticks == 0
    assert "stop" not in transport.calls


async def test_a_cpu_mode_disagreeing_with_the_boundary_is_counted() -> None:
    r0, pages = kernel_cpu()
    odd = regs(0, r0.pc, rsp=r0.sp, rbp=r0.fp, cpl=3)
    transport = FakeTransport({0: odd}, pages)
    sampler = make(transport, duration=0.02)
    await sampler.run()
    assert sampler.stats.mode_mismatch == 2
    assert any("mode (user or kernel) disagreed" in line for line in sampler.stats.detail_lines())


async def test_selecting_an_absent_cpu_is_a_usage_error() -> None:
    r0, pages = kernel_cpu()
    with pytest.raises(UsageError, match="no vCPU 3"):
        await make(FakeTransport({0: r0}, pages), cpus=(0, 3)).run()


def test_config_rejects_bad_values() -> None:
    with pytest.raises(UsageError):
        SamplerConfig(interval=0)
    with pytest.raises(UsageError):
        SamplerConfig(jitter=1.5)


async def test_summary_reports_counts_rate_and_pauses() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages, costs={"stop": 0.001, "cont": 0.001})
    sampler = make(transport, duration=0.1)
    await sampler.run()
    profile = sampler.profile
    lines = sampler.stats.summary_lines(
        len(profile), profile.truncated, len(profile.named_counts(Naming()))
    )
    assert lines[0] == "Samples: 10  Errors: 0  Truncated: 0  Filtered: 0  Unique stacks: 1"
    assert "Rate: 100.0 Hz of guest run time" in lines[1]
    assert "median 2.00 ms" in lines[2]
    assert sampler.stats.running_fraction() == pytest.approx(10 / 12, rel=0.02)


class ReadingIdentifier(KernelIdentifier[FakeSpace]):
    """Needs a fixed range (like the metadata page) to identify every sample."""

    def reads_for(self, regs: Registers) -> tuple[tuple[int, int], ...]:
        return ((K + 0x10_0000, 64),)


async def test_identity_reads_are_made_for_every_vcpu_while_stopped() -> None:
    r0, pages = kernel_cpu(0)
    transport = FakeTransport({0: r0, 1: regs(1, K + 0x3008, rsp=r0.sp, rbp=r0.fp)}, pages)
    sampler = make(transport, identifier=ReadingIdentifier(SPACE), duration=0.01, interval=0.01)
    await sampler.run()
    tick = transport.calls[transport.calls.index("stop") : transport.calls.index("cont")]
    assert tick[:3] == ["stop", "registers:0", "registers:1"]
    identity = f"read:{K + 0x10_0000:#x}+{64:#x}"
    assert tick.count(identity) == 2  # one per vCPU, while the guest is stopped, just its bytes
    assert len(sampler.profile) == 2  # an unmapped identity page costs nothing more


async def test_an_overhead_budget_lengthens_intervals_and_ends_by_run_time() -> None:
    r0, pages = kernel_cpu()
    # Pauses of 5 ms against a 2 ms interval: unbudgeted, the guest would stand stopped 71 %.
    transport = FakeTransport({0: r0}, pages, costs={"stop": 0.005})
    sampler = make(transport, interval=0.002, duration=0.5, max_overhead=0.2)
    await sampler.run()
    stats = sampler.stats
    assert stats.run_time == pytest.approx(0.5, abs=0.03)
    # Aimed at 90 % of the budget: 18 %, under the 20 % asked.
    assert 1 - stats.running_fraction() == pytest.approx(0.18, abs=0.01)
    assert sampler.interval == pytest.approx(0.005 * (1 - 0.18) / 0.18)
    assert 18 <= stats.ticks <= 36  # not the 250 an unbudgeted run would take
    lines = stats.summary_lines(len(sampler.profile), 0, 1)
    assert any("budget 20.0%" in line for line in lines)
    assert "500.0 Hz asked" in lines[1]


async def test_cheap_pauses_keep_the_asked_interval_under_a_budget() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages, costs={"stop": 0.0005})
    sampler = make(transport, interval=0.010, duration=0.1, max_overhead=0.2)
    await sampler.run()
    assert sampler.interval == pytest.approx(0.010) and sampler.stats.ticks == 10


async def test_the_interval_follows_pauses_up_to_its_ceiling_and_back_across_takes() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages, costs={"stop": 0.004})
    sampler = make(transport, interval=0.010, duration=2.0, max_overhead=0.01, max_interval=0.2)
    await sampler.run()
    assert sampler.interval == pytest.approx(0.2)  # 4 ms pauses would need 0.44 s at 0.9 %
    sampler.take()
    transport.costs["stop"] = 0.0005  # pauses shrink: the interval comes down again
    for _ in range(3):
        await sampler.run()
        sampler.take()
    assert sampler.interval == pytest.approx(0.0005 * (1 - 0.009) / 0.009, rel=0.05)
    sampler.take()
    transport.costs["stop"] = 0.00001
    await sampler.run()
    assert sampler.interval == pytest.approx(0.010)  # never below the interval asked


def test_too_few_samples_are_warned_about() -> None:
    stats = SamplerStats(ticks=50, run_time=0.5, wall_time=0.6)
    assert any(
        line.startswith("Warning: only 50 samples") for line in stats.summary_lines(50, 0, 3)
    )
    assert not any("Warning" in line for line in stats.summary_lines(500, 0, 3))
    one_shot = SamplerStats(ticks=1)
    assert not any("Warning" in line for line in one_shot.summary_lines(2, 0, 2))
    with pytest.raises(UsageError, match="overhead"):
        SamplerConfig(max_overhead=1.5)


def by_page(lo: int, end: int) -> list[str]:
    """The reads of a first window [lo, end): page by page."""
    cuts = [lo, *range((lo & ~0xFFF) + 0x1000, end, 0x1000), end]
    return [f"read:{a:#x}+{b - a:#x}" for a, b in itertools.pairwise(cuts)]


async def test_what_was_collected_is_taken_and_the_next_run_starts_afresh() -> None:
    r0, pages = kernel_cpu(0)
    transport = FakeTransport({0: r0}, pages)
    sampler = make(transport, duration=0.02, interval=0.01)
    await sampler.run()
    profile, stats = sampler.take()
    assert (len(profile), stats.ticks, len(stats.pauses)) == (2, 2, 2)
    assert (len(sampler.profile), sampler.stats.ticks) == (0, 0)
    assert sampler.stats.requested_hz == stats.requested_hz
    await sampler.run()  # a whole run again: its tick count starts from zero
    assert (len(sampler.profile), sampler.stats.ticks) == (2, 2) and len(profile) == 2


class ScriptedWaiting:
    """Off CPU: one task asleep in schedule, called from user_main; ``look`` records whether the
    guest ran when it worked (``running`` awaited first)."""

    def __init__(self, transport: FakeTransport) -> None:
        self.transport = transport
        self.looks: list[bool] = []
        self.quiets = 0  # ticks that waited for the looks' reads first

    async def look(self, running: Callable[[], Awaitable[object]]) -> None:
        await running()
        self.looks.append(self.transport.calls.count("stop") == self.transport.calls.count("cont"))

    async def quiet(self) -> None:
        self.quiets += 1

    def samples(self, on_cpu: Sequence[Sample]) -> list[Sample]:
        return [SLEEPER]


# The same object at every tick, as OffCpuTasks gives a task that stands still.
SLEEPER = Sample(0.0, NO_CPU, Mode.KERNEL, False, 0,
                 Stack((Frame(K + 0x2010, True, "schedule"), Frame(0x40_1010, False, "user_main"))),
                 Process(5, "sleeper", 0, 5), "S")  # fmt: skip


@pytest.mark.parametrize(
    ("keep", "names"),
    [
        (None, ("sleeper (pid 5)", "[off-cpu: S]", "user_main", "schedule_[k]")),
        (Mode.KERNEL, ("sleeper (pid 5)", "[off-cpu: S]", "schedule_[k]")),
        (Mode.USER, ("sleeper (pid 5)", "[off-cpu: S]", "user_main")),
    ],
)
async def test_each_tick_adds_the_tasks_off_cpu_looked_at_while_the_guest_runs(
    keep: Mode | None, names: tuple[str, ...]
) -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    waiting = ScriptedWaiting(transport)
    sampler = Sampler(
        transport,
        FramePointerUnwinder(),
        KernelIdentifier(SPACE),
        SamplerConfig(duration=0.03, interval=0.01, keep=keep),
        clock=transport.clock,
        sleep=transport.clock.sleep,
        off_cpu=waiting,
    )
    await sampler.run()
    assert sampler.profile.named_counts(Naming())[names] == 3
    assert waiting.looks and all(waiting.looks)  # before the first tick, then between ticks
    assert waiting.quiets == 3
    times = [t for t, cpu, _ in sampler.profile.timeline() if cpu == NO_CPU]
    assert len(times) == 3 and times == sorted(set(times)) and times[0] > 0  # each tick's time
    taken, _ = sampler.take()  # a fresh profile: the sleeper's stack is stored in it again
    await sampler.run()
    assert sampler.profile.named_counts(Naming())[names] == 3
    assert sampler.profile.frames and taken.named_counts(Naming())[names] == 3


@dataclass(frozen=True, slots=True)
class ReadAgain:
    """An identity whose space may be read again (``reread_mappings``), counting the asks."""

    process: Process | None
    space: FakeSpace
    fresh: ReadAgain | None
    asked: list[tuple[int, ...]]
    memory: None = None
    registers: None = None
    complete: None = None

    @property
    def reread_mappings(self) -> Callable[[Sequence[int]], Awaitable[ReadAgain | None]]:
        async def read_again(pcs: Sequence[int]) -> ReadAgain | None:
            self.asked.append(tuple(pcs))
            return self.fresh

        return read_again


class ReadAgainIdentifier:
    def __init__(self, identity: ReadAgain) -> None:
        self.identity = identity

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        return ()

    async def identify(
        self, transport: FakeTransport, regs: Registers, cache: PageCache
    ) -> ReadAgain:
        return self.identity


@dataclass(frozen=True, slots=True)
class Completing:
    """An identity whose process's files are read after cont (``complete``), counting asks."""

    process: Process | None
    space: FakeSpace
    fresh: Completing | None
    calls: list[str]  # the transport's, so far
    asked: list[bool]  # each ask: whether the guest was let run before it
    memory: None = None
    registers: None = None
    reread_mappings: None = None

    @property
    def complete(self) -> Callable[[], Awaitable[Completing | None]]:
        async def read_files() -> Completing | None:
            self.asked.append("cont" in self.calls)
            return self.fresh

        return read_files


@pytest.mark.parametrize("read_since", [True, False])
async def test_a_walk_in_files_not_read_yet_is_walked_again_after_cont(
    read_since: bool,
) -> None:
    """A program started since the run began, its files not read when the pause met it: after
    cont the guest OS reads them and the pause's walk is walked again, over the pause's
    memory, in the space with them; when nothing better comes the pause's walk stands."""
    process = Process(7, "app", 0)
    user_main, *kernel = SPACE.symbols
    library = FakeSpace((user_main, (0x7F00_0000, 0x7F00_0100, "lib_fn"), *kernel))
    asked: list[bool] = []
    transport = FakeTransport({0: regs(0, 0x7F00_0010, rsp=0x7FFF_0000)}, {})
    fresh = Completing(process, library, None, transport.calls, asked) if read_since else None
    identity = Completing(process, SPACE, fresh, transport.calls, asked)
    sampler = Sampler(
        transport,
        FramePointerUnwinder(),
        ReadAgainIdentifier(identity),  # type: ignore[arg-type]
        SamplerConfig(),
        clock=transport.clock,
    )
    outcome = await sampler.run(one_shot=True)
    assert asked == [True]  # once, after cont
    (sample,) = outcome.last
    assert sample.stack.frames[0].symbol == ("lib_fn" if read_since else None)
    assert transport.calls.count("stop") == transport.calls.count("cont") == 1


@pytest.mark.parametrize("mapped_since", [True, False])
async def test_a_walk_into_user_code_its_space_lacks_asks_once_for_the_space_read_again(
    mapped_since: bool,
) -> None:
    """A library mapped after the process's space was read: the walk's user address in none
    of its code is handed to the guest OS, once, in the pause; a space read again is walked
    in, else the walk stands."""
    process = Process(7, "app", 0)
    user_main, *kernel = SPACE.symbols
    library = FakeSpace((user_main, (0x7F00_0000, 0x7F00_0100, "lib_fn"), *kernel))
    asked: list[tuple[int, ...]] = []
    fresh = ReadAgain(process, library, None, asked) if mapped_since else None
    identity = ReadAgain(process, SPACE, fresh, asked)
    transport = FakeTransport({0: regs(0, 0x7F00_0010, rsp=0x7FFF_0000)}, {})
    sampler = Sampler(
        transport,
        FramePointerUnwinder(),
        ReadAgainIdentifier(identity),
        SamplerConfig(),
        clock=transport.clock,
    )
    outcome = await sampler.run(one_shot=True)
    assert asked == [(0x7F00_0010,)]  # once: the space read again is not asked again
    (sample,) = outcome.last
    assert sample.stack.frames[0].symbol == ("lib_fn" if mapped_since else None)
    assert transport.calls.count("stop") == transport.calls.count("cont") == 1


class CountingUnwinder(FramePointerUnwinder):
    def __init__(self) -> None:
        super().__init__()
        self.walks: list[int] = []  # the pc each unwind() started from

    def unwind(self, regs: Registers, cache: PageCache, space: FakeSpace) -> RawStack:
        self.walks.append(regs.pc)
        return super().unwind(regs, cache, space)


async def test_a_long_wait_warms_up_just_before_the_stop_without_reading_the_guest() -> None:
    """At a 1 s interval each wait ends with a run-state query on the control channel and the
    last tick's walk again over the memory it read, LEAD before the stop; nothing is read from
    the guest meanwhile and the tick comes when it would have."""
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    unwinder = CountingUnwinder()
    sampler = make(transport, unwinder, interval=1.0, duration=3.0)
    await sampler.run()
    calls = transport.calls
    stops = [i for i, call in enumerate(calls) if call == "stop"]
    assert len(stops) == 3
    for before, stop in itertools.pairwise(stops):
        between = calls[calls.index("cont", before) + 1 : stop]
        assert between == ["is_running"]  # the warm-up: no read, no stop
    assert transport.clock.sleeps == pytest.approx([1.0 - LEAD, LEAD] * 3)
    assert len(unwinder.walks) == 3 + 2  # a walk per tick, and the last one again before two
    assert sampler.stats.run_time == pytest.approx(3.0)


async def test_short_waits_are_not_warmed_up() -> None:
    r0, pages = kernel_cpu()
    transport = FakeTransport({0: r0}, pages)
    unwinder = CountingUnwinder()
    sampler = make(transport, unwinder, interval=WARM_AFTER / 2, duration=WARM_AFTER * 2)
    await sampler.run()
    assert transport.calls.count("is_running") == 1  # the run's own, at its start
    assert len(unwinder.walks) == sampler.stats.ticks == 4
