"""What the sampler reads while the guest stands stopped: ``stop`` (unless the guest was paused
already), the registers of every selected vCPU (pipelined); per vCPU, who runs there (the guest
identifier) and its stack (``memory.StackReader``) read into a fresh PageCache, then unwound.
Naming the frames waits until the guest runs again (``StackUnwinder.resolve``).

One bad sample (a refused read, an unwinder bug) is data: its error is kept on it and counted
after cont; only a guest gone, or a kernel file that is not the guest's, ends the run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from qmpprof.errors import GuestGoneError, KernelMismatchError, QmpprofError, TransportError
from qmpprof.guest.base import Complete, GuestIdentifier, Identified
from qmpprof.memory import Reader, StackReader
from qmpprof.model import Mode, Process, Registers, Stack
from qmpprof.pagecache import PageCache, PageMissing, page_of
from qmpprof.stats import SamplerStats
from qmpprof.transport.base import GuestTransport, each_registers

Space = TypeVar("Space")
Space_contra = TypeVar("Space_contra", contravariant=True)
Raw = TypeVar("Raw")
T = TypeVar("T")
_REWALK_MISSES = 64  # pages a walk again may find missing before the last try stands


class StackUnwinder(Protocol[Space_contra, Raw]):
    """unwind() runs while stopped and may raise PageMissing; resolve() runs after cont.
    ``kernel_boundary``: the instruction set's split, where the configuration gives none."""

    @property
    def kernel_boundary(self) -> int: ...

    def unwind(self, regs: Registers, cache: PageCache, space: Space_contra) -> Raw: ...

    def unplaced(self, raw: Raw, space: Space_contra) -> Sequence[int]:
        """The user addresses of a walk that no code of ``space`` holds."""
        ...

    def resolve(self, raw: Raw, space: Space_contra) -> Stack: ...


@dataclass(slots=True)
class Captured(Generic[Space, Raw]):
    """One vCPU's state taken while stopped; turned into a Sample after cont."""

    regs: Registers
    time: float
    mode: Mode
    space: Space | None = None
    process: Process | None = None
    raw: Raw | None = None
    error: str | None = None
    # A process whose code was in files not read yet: asked after cont (``Capture.complete``)
    # for its space with them read, to walk ``walked`` over the pause's ``cache`` again.
    complete: Complete[Space] | None = None
    walked: Registers | None = None
    cache: PageCache | None = None


class Capture(Generic[Space, Raw]):
    """Reads the vCPUs of one guest while it stands stopped; counts into the ``stats`` of each
    call (the sampler hands over its statistics between runs). ``keep``: a vCPU in the other
    mode is captured without its memory (filtered after cont)."""

    def __init__(
        self,
        transport: GuestTransport,
        unwinder: StackUnwinder[Space, Raw],
        identifier: GuestIdentifier[Space],
        stacks: StackReader,
        *,
        boundary: int,
        keep: Mode | None,
        clock: Callable[[], float],
    ) -> None:
        self.transport = transport
        self.unwinder = unwinder
        self.identifier = identifier
        self.stacks = stacks
        self.boundary = boundary
        self.keep = keep
        self._clock = clock
        # Per vCPU, the last walk: its registers, the memory it read and its space.
        self._walks: dict[int, tuple[Registers, PageCache, Space]] = {}

    async def every_cpu(
        self, cpus: Sequence[int], stats: SamplerStats, start: float, *, stop: bool
    ) -> list[Captured[Space, Raw]]:
        """Stop, then every vCPU's registers, read together (over a gdbstub with the stop, in
        one round trip: the phase counted as the stop's); times from ``start``."""
        mark = self._clock()
        if stop:
            results = await self.transport.stop_and_registers(cpus)
            self._phase(stats, "stop", mark)
        else:
            results = await each_registers(self.transport, cpus)
            self._phase(stats, "registers", mark)
        taken: list[Registers] = []
        for regs in results:
            if isinstance(regs, TransportError):
                stats.errors[f"registers: {regs}"] += 1
            else:
                taken.append(regs)
        captured = await _together([self._one(regs, stats, start) for regs in taken])
        return [c for c in captured if isinstance(c, Captured)]  # exceptions were raised

    async def _one(
        self, regs: Registers, stats: SamplerStats, start: float
    ) -> Captured[Space, Raw]:
        mode = Mode.KERNEL if regs.pc >= self.boundary else Mode.USER
        # A vCPU that translates nothing (firmware) is on neither side of the boundary.
        if regs.user != (mode is Mode.USER) and regs.special.get("paging", 1):
            stats.mode_mismatch += 1
        captured: Captured[Space, Raw] = Captured(regs, self._clock() - start, mode)
        if self.keep is not None and mode is not self.keep:
            return captured  # filtered after cont; no need to read its memory
        cache, seen = PageCache(), PageCache()  # the stack's; what identify() reads
        mark = self._clock()
        try:
            # The stack window and what identify() needs are independent: issued together.
            # A refused identity read is retried (and counted) by identify() itself.
            await self.stacks.prefetch(regs, cache, self.identifier.reads_for(regs), seen)
            identity = await self.identifier.identify(self.transport, regs, seen)
            walked = regs if identity.registers is None else identity.registers
            if identity.memory is not None:  # user memory the vCPU does not show: read again
                cache = cache.above(self.boundary)
            seen.asked = []  # what the walk reads through page tables (identify's reader)
            captured.raw = await self._walk(captured, walked, cache, identity, stats)
            through, seen.asked = seen.asked, None
            reread = identity.reread_mappings
            lacking = () if reread is None else self.unwinder.unplaced(captured.raw, identity.space)
            fresh = await reread(lacking) if reread is not None and lacking else None
            if fresh is not None:  # user code mapped since its space was read: walked in it
                if fresh.memory is not None and identity.memory is None:
                    cache = cache.above(self.boundary)
                identity = fresh
                captured.raw = await self._walk(captured, walked, cache, identity, stats)
            self._walks[regs.cpu] = (walked, cache, identity.space)
            # User memory read through the task's tables (``through``: empty otherwise): the
            # window learns the kernel's part.
            floor = 0 if identity.memory is None else self.boundary
            self.stacks.learn(regs, cache, floor, through)
            if identity.complete is not None:
                captured.complete, captured.walked, captured.cache = (
                    identity.complete,
                    walked,
                    cache,
                )
        except (GuestGoneError, KernelMismatchError):
            raise  # the guest is gone, or the kernel file is not its kernel: the run ends
        except Exception as err:  # one bad sample (a refused read, an unwinder bug) is data
            captured.error = f"{type(err).__name__}: {err}"
        self._phase(stats, "memory", mark)
        return captured

    async def complete(self, captured: Sequence[Captured[Space, Raw]]) -> None:
        """After cont: each capture whose process's code was in files not read yet (a program
        started since the run began), walked again in its space with them read, over the
        memory its pause read (a page the pause did not read ends the walk there: the guest
        has run since). When nothing better comes, the pause's walk stands."""
        for one in captured:
            complete, one.complete = one.complete, None
            regs, cache, one.cache = one.walked, one.cache, None
            if complete is None or regs is None or cache is None or one.raw is None:
                continue
            try:
                fresh = await complete()
            except QmpprofError:
                continue  # a guest gone shows at the next stop
            if fresh is None:
                continue
            try:
                one.raw = _walk_over(self.unwinder, regs, cache, fresh.space)
            except Exception:  # an unwinder bug: the pause's walk stands
                continue
            one.space = fresh.space

    def rehearse(self) -> None:
        """Each vCPU's last walk again over a copy of the memory it read, the result dropped:
        run between ticks so that the unwinder's code and tables are warm at the next stop.
        Reads nothing from the guest and changes no state but the unwinder's caches."""
        for regs, cache, space in list(self._walks.values()):
            with contextlib.suppress(Exception):  # a walk that failed in the pause may again
                _walk_over(self.unwinder, regs, cache.above(0), space)

    async def _walk(
        self,
        captured: Captured[Space, Raw],
        regs: Registers,
        cache: PageCache,
        identity: Identified[Space],
        stats: SamplerStats,
    ) -> Raw:
        captured.process, captured.space = identity.process, identity.space
        return await self._unwind(regs, cache, identity.space, identity.memory, stats)

    async def _unwind(
        self,
        regs: Registers,
        cache: PageCache,
        space: Space,
        memory: Reader | None,
        stats: SamplerStats,
    ) -> Raw:
        unwinds = 0.0  # time in unwind() proper: the rest of the memory phase is reading

        def attempt() -> Raw:
            nonlocal unwinds
            mark = self._clock()
            try:
                return self.unwinder.unwind(regs, cache, space)
            finally:
                unwinds += self._clock() - mark

        try:
            return await self.stacks.complete(regs, cache, attempt, memory)
        finally:
            stats.phase_time["unwind"] += unwinds
            stats.phase_time["memory"] -= unwinds  # counted once, as unwinding

    def _phase(self, stats: SamplerStats, name: str, since: float) -> None:
        stats.phase_time[name] += self._clock() - since


def _walk_over(
    unwinder: StackUnwinder[Space, Raw], regs: Registers, cache: PageCache, space: Space
) -> Raw:
    """A walk over what ``cache`` holds alone: a page it lacks counts as unmapped."""
    for _ in range(_REWALK_MISSES):
        try:
            return unwinder.unwind(regs, cache, space)
        except PageMissing as miss:
            cache.pages[page_of(miss.addr)] = None
    return unwinder.unwind(regs, cache, space)


async def _together(
    calls: list[Coroutine[object, object, T]], *, return_exceptions: bool = False
) -> list[T | BaseException]:
    """asyncio.gather, except that a lone call is awaited directly: gather wraps each call in
    a task, which costs event-loop turns in the middle of the guest's pause."""
    if len(calls) != 1:
        return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))
    try:
        return [await calls[0]]
    except Exception as err:
        if not return_exceptions:
            raise
        return [err]
