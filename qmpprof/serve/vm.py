"""One VM that ``qmpprof serve`` follows: connect, sample for as long as it lives, reconnect.

A session is one ``session.start`` (a Sampler over a fresh transport). Its sampler runs one
second of guest run time at a time (FLUSH): the sampler's own loop keeps every pause short and
resumes the guest after each tick, and each run reads the run state first: a paused guest is
looked at every RETRY seconds without stop/cont and left paused. (A pause made by someone else
in the middle of a run is undone by the run's next tick: QMP's stop succeeds on a paused guest,
so the sampler cannot tell its own stop from theirs.) After each run the sampler's profile and
statistics are taken out of it into the ring (``Ring.push``) and the totals, so nothing grows
with the uptime; ``request_stop`` ends a run after the tick in progress, so the guest is never
left stopped. A VM that is not there (no socket, nobody listening, QEMU killed, a libvirt domain
that no longer runs) is "down" and tried again every RETRY seconds.

Each VM has its own run: the command line's, with its ``--config`` table applied, and with the
``NAME.toml`` beside its socket read again at each connection (a bad one leaves the VM down,
the reason shown). Each VM follows in a thread and event loop of its own (``in_thread``): its
pauses do not wait for the other VMs' work, and loading its kernel (a second or two) holds up
no other VM; VMs with the same kernel share one load (the guest OSes keep what they loaded).
Under a budget the sampler lengthens the interval when pauses cost more; the interval in force
is kept here for the pages.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from qmpprof import session
from qmpprof.errors import ConnectError, QmpprofError
from qmpprof.guest.base import Warns
from qmpprof.serve.config import read_beside
from qmpprof.serve.ring import Ring, SecondSlice
from qmpprof.session import Run, RunSpec
from qmpprof.stats import SamplerStats
from qmpprof.transport import Reach

RETRY = 1.0  # seconds between connection attempts, and between looks at a paused guest
FLUSH = 1.0  # seconds of guest run time per sampler run, and per entry of the ring
LIVE = 10  # seconds the live numbers (rate, pause, stopped share) cover
# Upper bounds of the pause histogram, in seconds (Prometheus "le").
PAUSE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class Live:
    """The last LIVE seconds: ticks per wall second, median pause, share of time stopped."""

    rate_hz: float = 0.0
    median_pause_ms: float = 0.0
    stopped: float = 0.0

    @classmethod
    def of(cls, seconds: tuple[SecondSlice, ...], now: float) -> Live:
        """From the seconds that ended in the last LIVE seconds before ``now``."""
        seconds = tuple(s for s in seconds if s.end >= now - LIVE)
        span = seconds[-1].end - seconds[0].start if seconds else 0.0
        if span <= 0:
            return cls()
        pauses = [p for s in seconds for p in s.pauses]
        ticks = sum(s.ticks for s in seconds)
        median = statistics.median(pauses) * 1e3 if pauses else 0.0
        return cls(ticks / span, median, min(1.0, sum(pauses) / span))


class Vm:
    """One followed VM: its ring, its totals since serve started, and whether it is up."""

    def __init__(
        self, name: str, reach: Reach, spec: RunSpec, window: int, beside: Path | None = None
    ) -> None:
        """``reach``: where the VM is (its QMP socket, or its libvirt domain); ``spec``: this
        VM's run but for where; ``beside``: a NAME.toml that may be there, read at each
        connection."""
        self.name = name
        self.reach = reach
        self.base = spec
        self.beside = beside
        self.spec = self._spec(spec)
        self.interval = self.spec.sampling.interval  # in force (seconds of guest run time)
        self.boundary: int | None = None  # where its kernel's code starts, once attached
        self.ring = Ring(window)
        self.state = "down"  # up, down, paused
        self.problem = ""  # why it is down, or the most frequent sample error of late
        self.notes: tuple[str, ...] = ()  # what the user should be told of its run, one line each
        self.samples_total = 0
        self.off_cpu_total = 0  # samples of tasks off CPU (--off-cpu)
        self.errors_total = 0
        self.truncated_total = 0
        self.truncated_in_kernel_total = 0
        self.pause_counts = [0] * (len(PAUSE_BUCKETS) + 1)  # per bucket, the last is +Inf
        self.pause_sum = 0.0
        self.sampled_seconds = 0.0  # wall time the ring's seconds spanned, since serve started
        self._asked = threading.Event()  # stop() was called, from any thread
        self._loop: asyncio.AbstractEventLoop | None = None  # follow()'s, once it runs
        self._stopping = asyncio.Event()  # the same, in follow()'s loop
        self._sampler: Run | None = None
        self._since = time.monotonic()  # start of the second being collected

    def _spec(self, spec: RunSpec) -> RunSpec:
        sampling = dataclasses.replace(spec.sampling, duration=FLUSH)
        return dataclasses.replace(spec, reach=self.reach, sampling=sampling)

    def settings(self) -> RunSpec:
        """This VM's run now: the NAME.toml beside its socket read again, if there is one."""
        if self.beside is None or not self.beside.exists():
            return self._spec(self.base)
        return self._spec(read_beside(self.beside).apply(self.base))

    @property
    def budget(self) -> float | None:
        return self.spec.sampling.max_overhead

    @property
    def up(self) -> bool:
        return self.state == "up"

    def live(self) -> Live:
        return Live.of(self.ring.last(LIVE), time.monotonic())

    def stop(self) -> None:
        """End following: the sampler stops after its tick in progress (safe to call any
        time, from any thread)."""
        self._asked.set()
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # follow() ended and its loop closed
                loop.call_soon_threadsafe(self._stop_here)

    def _stop_here(self) -> None:
        self._stopping.set()
        if self._sampler is not None:
            self._sampler.request_stop()

    async def follow(self) -> None:
        """Sessions one after the other, until ``stop``."""
        self._stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self._asked.is_set():
            self._stopping.set()
        while not self._stopping.is_set():
            try:
                await self._session()
            except QmpprofError as err:
                self.problem = str(err)
            except Exception as err:  # a bug in one VM's session must not end the others
                self.problem = f"{type(err).__name__}: {err}"
            self.state = "down"
            await self._pause(RETRY)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _session(self) -> None:
        if self.reach.domain is None:
            await _listening(self.reach.qmp_socket)  # cheap, before the files load
        # A domain's own <kernel> and <initrd> where none is given.
        self.spec, booted = session.with_boot_files(self.settings())
        spec = self.spec
        guest = session.load(spec)  # in this VM's own thread
        connection = await session.attach(guest, await session.connect(spec))
        self.notes = (*booted, *connection.notes)  # shown on the index, as the command says them
        sampler = session.sampler(spec, guest, connection, self._on_tick)
        self.interval, self.boundary = sampler.interval, sampler.boundary
        try:
            self._sampler = sampler
            self._since = time.monotonic()
            self.state, self.problem = "up", ""
            while not self._stopping.is_set():
                outcome = await sampler.run()
                if outcome.was_running:
                    self.take(sampler, keep=True)
                else:
                    self.state = "paused"
                    self.take(sampler, keep=False)  # one look without stop/cont: no profile
                    await self._pause(RETRY)
        finally:
            self._sampler = None
            self.take(sampler, keep=True)
            if isinstance(guest, Warns):  # what the guest OS could not read, said once
                self.notes = (*self.notes, *guest.warnings())
            await sampler.transport.close()

    def _on_tick(self, stats: SamplerStats) -> None:
        self.state = "up"  # again, after a pause

    def take(self, sampler: Run, *, keep: bool) -> None:
        """Move what the sampler collected since the last call into the ring and totals."""
        now = time.monotonic()
        profile, stats = sampler.take()
        errors = stats.error_count
        if stats.errors:
            self.problem = stats.errors.most_common(1)[0][0]
        since, self._since = self._since, now
        self.interval = sampler.interval
        if not keep or not (stats.pauses or len(profile)):
            return
        second = self.ring.push(
            profile, since, now, ticks=stats.ticks, errors=errors, pauses=stats.pauses
        )
        self.samples_total += second.samples
        self.off_cpu_total += second.off_cpu
        self.sampled_seconds += second.end - second.start
        self.truncated_total += second.truncated
        self.truncated_in_kernel_total += second.truncated_in_kernel
        self.errors_total += errors
        for pause in stats.pauses:
            self.pause_counts[bisect.bisect_left(PAUSE_BUCKETS, pause)] += 1
            self.pause_sum += pause


def in_thread(vm: Vm) -> asyncio.Future[None]:
    """``vm.follow()`` in a thread and event loop of its own; done (in the calling loop) when
    it ends. Why a thread per VM: in one event loop, a VM stood stopped while the loop did the
    other VMs' work (walking and naming their stacks, their housekeeping); in threads, the
    interpreter switches to the stopped VM's thread within ``sys.getswitchinterval()``."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    def run() -> None:
        try:
            asyncio.run(vm.follow())
        finally:
            with contextlib.suppress(RuntimeError):  # serve's own loop is gone
                loop.call_soon_threadsafe(finished)

    threading.Thread(target=run, name=f"vm {vm.name}", daemon=True).start()
    return done


async def _listening(socket: Path) -> None:
    """ConnectError unless something accepts connections on ``socket`` (a socket file stays
    behind when QEMU is killed)."""
    try:
        _, writer = await asyncio.open_unix_connection(str(socket))
    except FileNotFoundError:
        raise ConnectError(f"no QMP socket at {socket}") from None
    except OSError as err:
        raise ConnectError(f"{socket}: {err.strerror or err}") from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
