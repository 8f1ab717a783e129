"""The one asyncio orchestrator: when to stop the guest, what to read while it is stopped, and
what to do after it runs again.

Per tick: what is read while the guest stands stopped (``capture.Capture``: ``stop``, every
selected vCPU's registers, who runs there and its stack, unwound); ``cont``. Resolving frames,
filtering and adding to the profile happen after ``cont``, while the guest runs again. The
sampler orchestrates; the profile counts.

Its other parts: when the next tick is due (``pacing.Pacing``: the interval is guest *run* time
between samples, the duration counts the same run time, so a 5 s run at 10 ms asks for 500
ticks), the interval in force under ``--max-overhead`` (``budget.OverheadBudget``), the work
between ticks while the guest runs (``housework.Housework``: the guest OS's housekeeping and the
off-CPU looks, beside the wait for the next tick, never in its way) and the tasks off CPU filed
at each tick (``offcpufiling``).

Safety: the guest is left in the run state it had. A paused guest is sampled once without
stop/cont. Errors inside one sample are counted (stats), never raised; only GuestGoneError and
transport failures around stop/cont end a run, and the profile collected so far stays here. A
guest something else stopped between two ticks (GuestHeldError from the stop) ends the run too,
and is left stopped: that pause is not the sampler's to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from qmpprof.budget import OverheadBudget
from qmpprof.capture import Capture, Captured, StackUnwinder
from qmpprof.errors import GuestHeldError, QmpprofError, UsageError
from qmpprof.guest.base import GuestIdentifier
from qmpprof.housework import Housework
from qmpprof.memory import MAX_REFETCH, WINDOW, StackReader
from qmpprof.model import Mode, Sample, Stack
from qmpprof.offcpufiling import OffCpu, OffCpuFiling
from qmpprof.pacing import Pacing
from qmpprof.profile import Profile
from qmpprof.stats import SamplerStats
from qmpprof.transport.base import GuestTransport

Space = TypeVar("Space")
Raw = TypeVar("Raw")
# A wait this long or longer ends with a warm-up LEAD seconds before the stop: what the stop
# will touch, in QEMU and here, has not been touched for as long, and on some hosts memory idle
# for 0.1-1 s costs 10-20x more to touch again (docs/bench.md, issue 36). Shorter waits keep it
# warm by themselves.
WARM_AFTER = 0.040
LEAD = 0.004


@dataclass(frozen=True, slots=True)
class SamplerConfig:
    interval: float = 0.010  # seconds of guest run time between ticks
    duration: float = 5.0  # seconds of guest run time to profile
    jitter: float = 0.0  # each interval is scaled by a uniform factor in [1-jitter, 1+jitter]
    cpus: tuple[int, ...] | None = None  # None: every vCPU
    window: int = WINDOW  # stack bytes read at RSP in one call
    kernel_boundary: int | None = None  # None: the unwinder's (its instruction set's)
    keep: Mode | None = None  # --kernel-only / --user-only
    max_refetch: int = MAX_REFETCH  # pages fetched on the unwinder's demand per sample
    # The most of the wall time the guest may stand stopped (a fraction): intervals lengthen
    # when pauses grow, and the run then ends by guest run time. None: no budget.
    max_overhead: float | None = None
    # Under a budget, the longest interval it may ask for (seconds; never below ``interval``):
    # pauses too long for the budget even then are let through, and the share shows it.
    max_interval: float = 1.0

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.duration <= 0:
            raise UsageError("the interval and the duration must be positive")
        if not 0 <= self.jitter < 1:
            raise UsageError("jitter must be a fraction in [0, 1)")
        if self.max_overhead is not None and not 0 < self.max_overhead < 1:
            raise UsageError("the overhead budget must be a fraction in (0, 1)")
        if self.max_interval <= 0:
            raise UsageError("the longest interval must be positive")


@dataclass(frozen=True, slots=True)
class RunOutcome:
    was_running: bool
    last: tuple[Sample, ...]  # the samples of the last tick (what --one-shot prints)


class Sampler(Generic[Space, Raw]):
    """Samples one guest into ``self.profile`` and ``self.stats``."""

    def __init__(
        self,
        transport: GuestTransport,
        unwinder: StackUnwinder[Space, Raw],
        identifier: GuestIdentifier[Space],
        config: SamplerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
        on_tick: Callable[[SamplerStats], None] | None = None,
        housekeeping: Callable[[], Awaitable[None]] | None = None,
        off_cpu: OffCpu | None = None,
    ) -> None:
        """``housekeeping``: started after every tick unless the last one still runs, while
        the guest runs (the guest OS's slow changes, e.g. modules loaded; it keeps its own
        schedule), beside the wait for the next tick; its errors are dropped (a guest gone
        shows at the next stop). ``off_cpu``: the tasks off CPU, looked at before the first
        tick and after the housekeeping; each tick adds their samples."""
        self.transport = transport
        self.unwinder = unwinder
        self.identifier = identifier
        self.config = config
        self.boundary = (
            unwinder.kernel_boundary if config.kernel_boundary is None else config.kernel_boundary
        )
        stacks = StackReader(transport, config.window, config.max_refetch)
        self.capture = Capture(
            transport, unwinder, identifier, stacks,
            boundary=self.boundary, keep=config.keep, clock=clock,
        )  # fmt: skip
        self.profile = Profile(interval_ms=config.interval * 1e3)
        self.stats = SamplerStats()
        self._clock = clock
        self._sleep = sleep
        self._rng = rng
        self._on_tick = on_tick
        self._off_cpu = off_cpu
        self._filing = OffCpuFiling(config.keep)
        self.housework = Housework(housekeeping, None if off_cpu is None else off_cpu.look)
        self.budget = OverheadBudget(config.interval, config.max_overhead, config.max_interval)
        self._held = 0.0  # run time the last tick waited for a look's read before its stop
        self._looked = False  # a look at every task before a run's first tick
        self._stop_requested = False
        self._woken: asyncio.Event | None = None  # set by request_stop: the wait ends at once
        self._start = 0.0
        self._resumed = 0.0  # when the guest last ran again: the interval counts from there
        self.stats.requested_hz = 1 / config.interval
        self.stats.budget = config.max_overhead

    @property
    def interval(self) -> float:
        """The interval in force: lengthened when pauses outgrow the budget."""
        return self.budget.interval

    def take(self) -> tuple[Profile, SamplerStats]:
        """What was collected so far, handed over; the sampler goes on with a fresh profile and
        fresh statistics (their pause list and error kinds would grow, and the tick count is
        what ends the next ``run``)."""
        taken = self.profile, self.stats
        self.profile = Profile(interval_ms=self.config.interval * 1e3)
        self.stats = SamplerStats(requested_hz=taken[1].requested_hz, budget=taken[1].budget)
        return taken

    def request_stop(self) -> None:
        """End the run after the current tick, or now if it waits for the next one (safe from
        a signal handler of the sampler's event loop)."""
        self._stop_requested = True
        if self._woken is not None:
            self._woken.set()

    async def run(self, *, one_shot: bool = False) -> RunOutcome:
        """Profile for the configured duration (or one tick). A paused guest is sampled once,
        without stop/cont, and stays paused."""
        was_running = await self.transport.is_running()
        cpus = await self._select_cpus()
        self._start = self._clock()
        if not was_running:
            return RunOutcome(False, tuple(await self._tick(cpus, stop=False)))
        if one_shot:
            return RunOutcome(True, tuple(await self._tick(cpus, stop=True)))
        if self._off_cpu is not None and not self._looked:
            # The first run's ticks need a look; a later run's (serve's, each second) have
            # the last one, and the next comes between ticks.
            await self._off_cpu.look(self.housework.running)
            self._looked = True
            self._start = self._clock()
        try:
            return await self._ticks(cpus)
        finally:
            await self.housework.finish()

    async def _ticks(self, cpus: Sequence[int]) -> RunOutcome:
        last: list[Sample] = []
        target = max(1, round(self.config.duration / self.config.interval))
        resumed = self._start
        pacing = Pacing(self.config.jitter, self._rng)
        duration = self.config.duration
        while (
            self.stats.ticks < target
            and not self._stop_requested
            and not self.budget.spent(self.stats.run_time, duration)
        ):
            await self._wait(pacing.wait(self.budget.interval, self._clock() - resumed))
            if self._stop_requested:
                break
            ran = self._clock() - resumed
            self.stats.run_time += ran
            pacing.ran(ran)
            last = await self._tick(cpus, stop=True)
            pacing.held(self._held)  # the guest ran on while the tick held
            resumed = self._resumed
            self.budget.adapt(self.stats.pauses[-1])
            if self._on_tick is not None:
                self._on_tick(self.stats)
            if not self._stop_requested:
                await self.housework.start()
        return RunOutcome(True, tuple(last))

    async def _wait(self, seconds: float) -> None:
        """Sleep until the next tick, or less when a stop is requested meanwhile (an interval
        the overhead budget lengthened may be seconds long); a long wait warms up first."""
        if seconds >= WARM_AFTER:
            await self._sleep_or_woken(seconds - LEAD)
            if self._stop_requested:
                return
            began = self._clock()
            await self._warm_up()
            seconds = LEAD - (self._clock() - began)
        await self._sleep_or_woken(max(0.0, seconds))

    async def _warm_up(self) -> None:
        """The guest running, touch what the coming stop will: QEMU's main loop and monitor
        through the control channel (a run-state query, where the transport has one), and
        here the last tick's walks again over the memory they read (no guest read). Its
        answers are dropped; a guest gone shows at the stop."""
        control = self.transport.control
        if control is not None:
            with contextlib.suppress(QmpprofError):
                await control.is_running()
        self.capture.rehearse()

    async def _sleep_or_woken(self, seconds: float) -> None:
        if self._woken is None:
            self._woken = asyncio.Event()
        sleeping = asyncio.ensure_future(self._sleep(seconds))
        woken = asyncio.ensure_future(self._woken.wait())
        try:
            await asyncio.wait((sleeping, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeping.cancel()
            woken.cancel()

    async def _select_cpus(self) -> tuple[int, ...]:
        present = await self.transport.cpus()
        if self.config.cpus is None:
            return tuple(present)
        absent = sorted(set(self.config.cpus) - set(present))
        if absent:
            raise UsageError(f"no vCPU {absent[0]} in this guest (it has {present})")
        return self.config.cpus

    async def _tick(self, cpus: Sequence[int], *, stop: bool) -> list[Sample]:
        """One stop/capture/cont cycle, then everything that can wait until the guest runs."""
        began = self._clock()
        if stop:
            with self.housework.held():  # from now no look's read starts
                if self._off_cpu is not None:
                    await self._off_cpu.quiet()  # one under way ends first, the guest running
                    self._held = self._clock() - began
                    self.stats.run_time += self._held
                    began = self._clock()
                captured = await self._stopped(cpus)
        else:
            captured = await self.capture.every_cpu(cpus, self.stats, self._start, stop=False)
        self.stats.pauses.append(self._clock() - began)
        self.stats.wall_time = self._clock() - self._start
        self.stats.ticks += 1
        await self.capture.complete(captured)  # a program's files the pause had not read
        samples = [s for s in map(self._finish, captured) if s is not None]
        if self._off_cpu is not None:
            at = began - self._start
            self._filing.file(self._off_cpu.samples(samples), at, self.profile, self.stats)
        return samples

    async def _stopped(self, cpus: Sequence[int]) -> list[Captured[Space, Raw]]:
        """Stop, capture, cont."""
        try:
            captured = await self.capture.every_cpu(cpus, self.stats, self._start, stop=True)
        except GuestHeldError:
            raise  # the pause is another's: not ours to end
        except BaseException:
            await self._resume_quietly()
            raise
        mark = self._clock()
        await self.transport.cont()
        self._resumed = self._clock()
        self._phase("cont", mark)
        return captured

    async def _resume_quietly(self) -> None:
        # Already failing (or cancelled): resume if QEMU still listens, keep the first error.
        with contextlib.suppress(QmpprofError):
            await self.transport.cont()

    def _finish(self, captured: Captured[Space, Raw]) -> Sample | None:
        """After cont: name the frames, filter, count, add to the profile."""
        if self.config.keep is not None and captured.mode is not self.config.keep:
            self.stats.filtered += 1
            return None
        if captured.error is not None or captured.space is None or captured.raw is None:
            self.stats.errors[captured.error or "no stack"] += 1
            return None
        try:
            stack = self.unwinder.resolve(captured.raw, captured.space)
        except Exception as err:  # as in the capture: counted, the run goes on
            self.stats.errors[f"resolve: {type(err).__name__}: {err}"] += 1
            return None
        if self.config.keep is Mode.KERNEL:
            stack = Stack(tuple(f for f in stack.frames if f.kernel), stack.stop)
        regs = captured.regs
        sample = Sample(
            captured.time, regs.cpu, captured.mode, regs.user, regs.space, stack, captured.process
        )
        self.profile.add(sample)
        return sample

    def _phase(self, name: str, since: float) -> None:
        self.stats.phase_time[name] += self._clock() - since
