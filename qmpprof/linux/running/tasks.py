"""Linux tasks: a ``task_struct``'s identity read at the offsets the kernel's own BTF gives (pid,
tgid, comm, flags, its thread group leader's comm, its mm and kernel stack), and what was read
of each task pointer, trusted for ``recheck`` seconds.

A process is its tgid and its leader's comm; kernel threads are named ``[comm]``
(``[kworker/0:1]``), the idle tasks ``swapper/N``. Between samples, while the guest runs, the
tasks sampled lately are read again through the control channel (``confirm``), so that a pause
reads a task's fields the first time it meets the task, not every ``recheck``.

A task pointer does not name one process for ever: an exec gives the task another program and
address space (its ``mm``), and a task that exited leaves its ``task_struct`` to the next one
(the slab reuses it at once on a guest that starts processes all the time). Its ``stamp`` (pid,
tgid, mm and comm, as read) tells: a pause reads the stamp of the task it expects with the stack
window, and a stamp that changed has the task read again. The comm is in it because an exec
gives the task its new mm before its new name (``begin_new_exec``: ``exec_mmap``, then
``__set_task_comm``): a task read in between would keep its parent's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from qmpprof.guest.base import Identity
from qmpprof.linux.btf import Btf
from qmpprof.memo import Memo
from qmpprof.memory import Reader, read_ints, read_one
from qmpprof.model import Process

RECHECK = 0.5  # seconds a task pointer's identity is trusted without reading the task again
CONFIRMED = 2  # task structs read again per confirmation, at most
LIMIT = 4096  # tasks remembered
# task_struct.flags: a kernel thread (include/linux/sched.h, the same from 5.10 to 7.2; BTF
# carries no #define).
PF_KTHREAD = 0x0020_0000
Stamp = tuple[int, int, int, int]  # a task's pid, tgid, mm and comm (its bytes as a number)


@dataclass(frozen=True, slots=True)
class TaskLayout:
    """Byte offsets in ``struct task_struct``, and the size of its ``comm``."""

    pid: int
    tgid: int
    comm: int
    comm_size: int  # TASK_COMM_LEN
    flags: int
    group_leader: int
    mm: int
    tasks: int  # the list of every task, from init_task
    stack: int  # void *: the task's kernel stack

    def stamp_range(self, task: int) -> tuple[int, int]:
        """Where the task at ``task`` keeps its stamp: the bytes from the first to the last of
        pid, tgid, mm and comm (688 on 6.12, 696 on 5.10, 720 on 6.1, 680 on 7.2)."""
        low = self._stamp_low
        high = max(self.pid + 4, self.tgid + 4, self.mm + 8, self.comm + self.comm_size)
        return task + low, high - low

    def stamp_of(self, raw: bytes) -> Stamp:
        """(pid, tgid, mm, comm) from the bytes at ``stamp_range``: comm's bytes as a number."""
        low = self._stamp_low

        def number(offset: int, size: int) -> int:
            return int.from_bytes(raw[offset - low : offset - low + size], "little")

        return (
            number(self.pid, 4), number(self.tgid, 4), number(self.mm, 8),
            number(self.comm, self.comm_size),
        )  # fmt: skip

    @property
    def _stamp_low(self) -> int:
        return min(self.pid, self.tgid, self.mm, self.comm)

    @classmethod
    def from_btf(cls, btf: Btf) -> TaskLayout:
        """Raises KeyError naming what this kernel's BTF lacks."""
        field = btf.offset_of
        comm = btf.field("task_struct.comm")
        return cls(
            pid=field("task_struct.pid"),
            tgid=field("task_struct.tgid"),
            comm=comm.offset,
            comm_size=btf.array(comm.type_id)[1],
            flags=field("task_struct.flags"),
            group_leader=field("task_struct.group_leader"),
            mm=field("task_struct.mm"),
            tasks=field("task_struct.tasks"),
            stack=field("task_struct.stack"),
        )


@dataclass(frozen=True, slots=True)
class Task:
    pid: int
    tgid: int
    comm: str
    kernel_thread: bool
    leader_comm: str
    mm: int  # its address space (struct mm_struct *), 0 for kernel threads
    stack: int  # its kernel stack's lowest address
    stamp: Stamp = (0, 0, 0, 0)  # pid, tgid, mm, comm as read (TaskLayout.stamp_of)

    @property
    def process(self) -> Process:
        """The process (tgid, leader's comm) and this thread (pid, comm)."""
        if self.pid == 0:
            return Process(0, self.comm, 0, 0, self.comm)  # swapper/N, the idle task of CPU N
        if self.kernel_thread:
            return Process(self.tgid, f"[{self.comm}]", 0, self.pid, self.comm)
        return Process(self.tgid, self.leader_comm, 0, self.pid, self.comm)


async def read_task(read: Reader, task: int, layout: TaskLayout, kernel_from: int) -> Task | None:
    """The task at ``task`` (its fields in one read, its leader's comm in a second when it is
    not its own leader); None when it does not read. ``kernel_from``: the lowest kernel
    address (a leader pointer below it is not one)."""
    raw = await read_one(read, *task_range(task, layout))
    if raw is None:
        return None
    found, leader = parse_task(raw, task, layout, kernel_from)
    if leader is None:
        return found
    return with_leader(found, await read_one(read, leader + layout.comm, layout.comm_size))


def _fields(layout: TaskLayout) -> tuple[tuple[int, int], ...]:
    return (
        (layout.pid, 4), (layout.tgid, 4), (layout.comm, layout.comm_size), (layout.flags, 4),
        (layout.group_leader, 8), (layout.mm, 8), (layout.stack, 8),
    )  # fmt: skip


def task_range(task: int, layout: TaskLayout) -> tuple[int, int]:
    """Where the fields ``parse_task`` reads lie: (address, size)."""
    fields = _fields(layout)
    low = min(offset for offset, _ in fields)
    high = max(offset + size for offset, size in fields)
    return task + low, high - low


def parse_task(
    raw: bytes, task: int, layout: TaskLayout, kernel_from: int
) -> tuple[Task, int | None]:
    """The task from the bytes at ``task_range``, its leader's comm taken as its own, and the
    leader whose comm it has to be read from (None: its own leader, or none)."""
    low = min(offset for offset, _ in _fields(layout))

    def number(offset: int, size: int) -> int:
        return int.from_bytes(raw[offset - low : offset - low + size], "little")

    comm = _text(raw[layout.comm - low : layout.comm - low + layout.comm_size])
    leader, mm = number(layout.group_leader, 8), number(layout.mm, 8)
    kernel_thread = bool(number(layout.flags, 4) & PF_KTHREAD)
    found = Task(
        number(layout.pid, 4),
        number(layout.tgid, 4),
        comm,
        kernel_thread,
        comm,
        0 if kernel_thread else mm,
        number(layout.stack, 8),
        layout.stamp_of(raw[layout.stamp_range(task)[0] - task - low :]),
    )
    other = leader and leader != task and leader >= kernel_from
    return found, leader if other else None


def with_leader(task: Task, leader_comm: bytes | None) -> Task:
    """The task with its leader's comm as read (None: unread, its own kept)."""
    if leader_comm is None:
        return task
    return dataclasses.replace(task, leader_comm=_text(leader_comm) or task.comm)


async def task_list(read: Reader, init_task: int, layout: TaskLayout) -> list[int]:
    """Every task on the list of all tasks, from ``init_task`` (init_task itself left out)."""
    out: list[int] = []
    head = init_task + layout.tasks
    (node,) = await read_ints(read, [(head, 8)])
    visited = {head}
    while node is not None and node not in visited and len(visited) <= LIMIT:
        visited.add(node)
        out.append(node - layout.tasks)
        (node,) = await read_ints(read, [(node, 8)])
    return out


@dataclass(frozen=True, slots=True)
class Seen:
    """A task pointer's identity, from its fields (``task``, None when they did not read) as
    read or confirmed unchanged at ``checked``, and its kernel stack's lowest address."""

    identity: Identity
    checked: float
    task: Task | None

    @property
    def stack(self) -> int:
        return 0 if self.task is None else self.task.stack


class Tasks:
    """What was read of each task pointer, and when samples last used it."""

    def __init__(self, clock: Callable[[], float], recheck: float = RECHECK) -> None:
        self.clock = clock
        self.recheck = recheck
        self._seen: Memo[int, Seen] = Memo(LIMIT)
        self._used: Memo[int, float] = Memo(LIMIT)

    def fresh(self, task: int, stamp: Stamp | None = None) -> Seen | None:
        """What a sample may take of ``task`` without reading it (and note that one did):
        with the task's ``stamp`` as a pause read it, what was read of it if the stamp is the
        same (from now on trusted for ``recheck``); without, what was read or confirmed within
        ``recheck``."""
        now = self.clock()
        self._used.put(task, now)
        seen = self._seen.get(task)
        if seen is None:
            return None
        if stamp is not None and seen.task is not None:
            if stamp != seen.task.stamp:
                return None
            if now - seen.checked > self.recheck / 2:
                seen = self._seen.put(task, dataclasses.replace(seen, checked=now))
            return seen
        return seen if now - seen.checked <= self.recheck else None

    def known(self, task: int) -> bool:
        """Whether something was read of ``task`` (at any age)."""
        return self._seen.get(task) is not None

    def put(self, task: int, found: Task | None, identity: Identity) -> Seen:
        return self._seen.put(task, Seen(identity, self.clock(), found))

    def update(self, task: int, identity: Identity) -> Seen:
        """The same task, its identity in another space (its mappings changed)."""
        return self._seen.put(task, dataclasses.replace(self._seen[task], identity=identity))

    def forget(self) -> None:
        self._seen = Memo(LIMIT)

    def on_stack(self, sp: int, size: int) -> int | None:
        """A task read before (at any age) whose kernel stack of ``size`` bytes holds ``sp``."""
        for task, seen in self._seen.items():
            if seen.task is not None and 0 < seen.task.stack <= sp < seen.task.stack + size:
                return task
        return None

    async def confirm(self, read: Reader, layout: TaskLayout, kernel_from: int) -> None:
        """Read again the fields of the tasks samples used lately whose identity is 3/4 of
        ``recheck`` old: unchanged, it is trusted for another ``recheck`` seconds, so no pause
        has to read them; changed (the pointer now holds another task, an exec renamed it), the
        next sample of it reads them."""
        now = self.clock()
        due = sorted(
            (seen.checked, task)
            for task, seen in self._seen.items()
            if now - seen.checked >= self.recheck * 0.75
            and now - self._used.get(task, 0.0) <= 2 * self.recheck
        )
        for _, task in due[:CONFIRMED]:
            seen = self._seen[task]
            found = await read_task(read, task, layout, kernel_from)
            if self._seen.get(task) is not seen:
                continue  # read again by a sample meanwhile, or started over
            if found == seen.task:
                self._seen[task] = dataclasses.replace(seen, checked=now)
            else:
                del self._seen[task]


def _text(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")
