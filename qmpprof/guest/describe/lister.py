"""Every task of a described kernel (its ``tasks`` keys, tasks.py) as ``--off-cpu`` takes them:
each task switched out, with the registers its kernel stack resumes from, read through the
transport while the guest is stopped (or, between ticks, running: each task's ``version``, its
state and saved pc and sp, is read again to tell it stood still).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from qmpprof.arch.base import InstructionSet
from qmpprof.guest.base import FoundTask
from qmpprof.guest.describe.compile import Env, Unreadable
from qmpprof.guest.describe.description import Description
from qmpprof.guest.describe.tasks import Switched, TaskKeys
from qmpprof.memory import Reader, fetch_piece, reader
from qmpprof.model import Process, Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import AddressSpace

T = TypeVar("T")
MAX_ROUNDS = 64  # reads one evaluation may make one after the other (a list: one per task)


class Missing(Exception):
    def __init__(self, addr: int, size: int) -> None:
        super().__init__(f"{size} bytes at {addr:#x} not fetched")
        self.addr, self.size = addr, size


class Fetched:
    """The page cache as the expressions read it: what is not fetched yet raises Missing with
    its whole range (PageMissing knows only the address)."""

    def __init__(self, cache: PageCache) -> None:
        self.cache = cache

    def read(self, addr: int, size: int) -> bytes | None:
        if not self.cache.has(addr, size):
            raise Missing(addr, size)
        return self.cache.read(addr, size)


async def settled(
    evaluate: Callable[[], T], read: Reader, cache: PageCache, rounds: int = MAX_ROUNDS
) -> T:
    """``evaluate()`` once everything it reads is fetched, one request per range it misses."""
    for _ in range(rounds):
        try:
            return evaluate()
        except Missing as missing:
            await fetch_piece(read, cache, missing.addr, missing.size)
    raise Unreadable(f"more than {rounds} reads one after the other")


class SwitchedTasks:
    """The tasks of ``description`` (it has task keys) in the kernel's ``space``."""

    def __init__(
        self, description: Description, keys: TaskKeys, space: AddressSpace, arch: InstructionSet
    ) -> None:
        self.description, self.keys, self.space, self.arch = description, keys, space, arch
        self.first_unreadable: Unreadable | None = None

    async def every_task(self, transport: GuestTransport) -> list[FoundTask]:
        regs = await transport.registers(0)
        read, cache = reader(transport, 0), PageCache()
        env = Env(0, regs, Fetched(cache))
        try:
            every = await settled(lambda: self.keys.all(env), read, cache)
        except Unreadable as err:
            self.first_unreadable = self.first_unreadable or err
            return []
        out = []
        for task in every:
            switched = await self._switched(env, task, read, cache)
            if switched is not None:
                out.append(await self._found(env, switched, regs, read, cache))
        return out

    async def _switched(
        self, env: Env, task: int, read: Reader, cache: PageCache
    ) -> Switched | None:
        try:
            return await settled(lambda: self.keys.switched(env, task), read, cache)
        except Unreadable as err:  # this task is left out; the others go on
            self.first_unreadable = self.first_unreadable or err
            return None

    async def _found(
        self, env: Env, switched: Switched, regs: Registers, read: Reader, cache: PageCache
    ) -> FoundTask:
        process = None
        try:
            about = await settled(lambda: self.description.about(env, switched.task), read, cache)
            # One thread a task: the description tells no threads apart (yet).
            root = about.root or 0
            process = Process(about.pid, about.name, root, space_name="root", tid=about.pid)
        except Unreadable as err:
            self.first_unreadable = self.first_unreadable or err
        kernel = _registers(regs, switched, self.arch)
        version = (switched.pc, switched.sp)
        return FoundTask(
            process, switched.state, switched.state, None, self.space, kernel,
            read=read, at=switched.task, version=version,
        )  # fmt: skip

    async def versions(
        self, transport: GuestTransport, tasks: Sequence[FoundTask]
    ) -> list[tuple[int, ...] | None]:
        regs = await transport.registers(0)
        read, cache = reader(transport, 0), PageCache()
        env = Env(0, regs, Fetched(cache))
        out: list[tuple[int, ...] | None] = []
        for task in tasks:
            switched = await self._switched(env, task.at, read, cache)
            out.append(None if switched is None else (switched.pc, switched.sp))
        return out


def _registers(regs: Registers, switched: Switched, arch: InstructionSet) -> Registers:
    """The registers a switched-out task resumes with (its frame pointer, when not said: 0)."""
    pc, sp, fp = switched.pc, switched.sp, switched.fp or 0
    gprs = {arch.pc: pc, arch.sp: sp, arch.fp: fp}
    return Registers(regs.cpu, arch.name, pc, sp, fp, False, regs.space, gprs=gprs)
