"""Every task of a stopped Linux guest: who it is, its state as the kernel reports it, the vCPU
it runs on if any, and, for a task off CPU, where its stacks resume.

The tasks: the list of every process from ``init_task`` (``tasks``), and each process's
threads (``signal->thread_head``, linked through ``thread_node``), at BTF's offsets. The idle
tasks (pid 0) are on neither list and are left out.

The state: ``__state`` (``state`` before 5.14), or'ed with ``exit_state``, decoded as
fs/proc/array.c does, with the letters and names of its ``task_state_array`` read from the
running kernel ("R (running)", "S (sleeping)", ...): entry 0 is a running task, entry i the
state bit 1 << (i - 1), the last one ("I (idle)") an uninterruptible sleep that does not count
towards the load (TASK_NOLOAD, the one bit no description carries).

A task off CPU resumes where its context switch left it, and a task with a process beneath it
entered the kernel from user mode with the registers at the top of its kernel stack: each
instruction set's kernel keeps them its own way (``switch.SwitchLayout``: x86_64's
``inactive_task_frame`` on the stack, arm64's ``thread.cpu_context``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.guest.base import FoundTask
from qmpprof.linux.btf import Btf
from qmpprof.linux.running.current import CurrentTask
from qmpprof.linux.running.pagetables import PageTables, split
from qmpprof.linux.running.platform import LinuxPlatform
from qmpprof.linux.running.spaces import Spaces
from qmpprof.linux.running.switch import SwitchLayout
from qmpprof.linux.running.tasks import (
    Task,
    TaskLayout,
    parse_task,
    task_list,
    task_range,
    with_leader,
)
from qmpprof.memory import Reader, read_ints, read_one

# TASK_NOLOAD (include/linux/sched.h: 0x400 in 5.10, 6.1, 6.12 and 7.2): with
# TASK_UNINTERRUPTIBLE it makes TASK_IDLE, which /proc reports as the array's last entry.
TASK_NOLOAD = 0x400
_STATE_TEXT = re.compile(rb"(\S) \(([^)]+)\)\0")
_MAX_STATES = 16
_MAX_THREADS = 4096


@dataclass(frozen=True, slots=True)
class OffCpuLayout:
    """Byte offsets of what a task off CPU leaves behind, and the sizes around them."""

    state: int
    state_size: int  # 8 for 5.10's long state, 4 for __state
    exit_state: int
    nvcsw: int  # task_struct's context-switch counts (unsigned long): voluntary
    nivcsw: int  # and involuntary
    signal: int
    thread_node: int
    thread_head: int  # signal_struct.thread_head
    switch: SwitchLayout  # the registers it was switched out with, and its user registers

    @classmethod
    def from_btf(cls, btf: Btf, arch: InstructionSet, platform: LinuxPlatform) -> OffCpuLayout:
        """Raises KeyError naming what this kernel's BTF lacks."""
        try:
            state = btf.field("task_struct.__state")
        except KeyError:
            state = btf.field("task_struct.state")
        return cls(
            state=state.offset,
            state_size=btf.size_of(state.type_id),
            exit_state=btf.offset_of("task_struct.exit_state"),
            nvcsw=btf.offset_of("task_struct.nvcsw"),
            nivcsw=btf.offset_of("task_struct.nivcsw"),
            signal=btf.offset_of("task_struct.signal"),
            thread_node=btf.offset_of("task_struct.thread_node"),
            thread_head=btf.offset_of("signal_struct.thread_head"),
            switch=platform.switch_layout(btf, arch),
        )


@dataclass(frozen=True, slots=True)
class States:
    """The kernel's task states, in ``task_state_array``'s order: (letter, name)."""

    names: tuple[tuple[str, str], ...]

    def decode(self, state: int, exit_state: int) -> tuple[str, str]:
        """The state /proc/PID/status shows for these values (``__task_state_index``)."""
        count = len(self.names)
        uninterruptible = 1 << (self.index("D") - 1)
        idle = uninterruptible | TASK_NOLOAD
        if state & idle == idle:
            return self.names[count - 1]
        reported = (state | exit_state) & ((1 << (count - 2)) - 1)
        return self.names[reported.bit_length()]

    def index(self, letter: str) -> int:
        return next(i for i, (found, _) in enumerate(self.names) if found == letter)


async def read_states(read: Reader, array: int, arch: InstructionSet) -> States | None:
    """``task_state_array`` at ``array``: its pointers, then each string, up to the first that
    is no state's; None when the first ones do not read as "R (running)", "S (...)", "D"."""
    raw = await read_one(read, array, 8 * _MAX_STATES)
    if raw is None:
        return None
    pointers = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
    found = await read([(p, 32) if p >= arch.shared_from else (p, 0) for p in pointers])
    names: list[tuple[str, str]] = []
    for text in found:
        match = None if text is None else _STATE_TEXT.match(text)
        if match is None:
            break
        names.append((match.group(1).decode(), match.group(2).decode()))
    if [letter for letter, _ in names[:3]] != ["R", "S", "D"]:
        return None
    return States(tuple(names))


async def threads(read: Reader, leaders: Sequence[int], layout: OffCpuLayout) -> list[int]:
    """Every thread of the processes whose leaders are ``leaders``, each leader first: their
    thread lists walked side by side, one read a step."""
    signals = await read_ints(read, [(task + layout.signal, 8) for task in leaders])
    members: dict[int, list[int]] = {leader: [] for leader in leaders}
    at = {
        leader: signal + layout.thread_head
        for leader, signal in zip(leaders, signals, strict=True)
        if signal
    }
    seen = {leader: {node} for leader, node in at.items()}
    while at:
        found = await read_ints(read, [(node, 8) for node in at.values()])
        step = {}
        for leader, node in zip(at, found, strict=True):
            if node is None or node in seen[leader] or len(seen[leader]) > _MAX_THREADS:
                continue
            seen[leader].add(node)
            if node - layout.thread_node != leader:
                members[leader].append(node - layout.thread_node)
            step[leader] = node
        at = step
    return [task for leader in leaders for task in (leader, *members[leader])]


@dataclass(frozen=True, slots=True)
class TaskListReader:
    """What reading every task of a stopped guest takes, put together when attached."""

    init_task: int
    tasks: TaskLayout
    layout: OffCpuLayout
    states: States
    arch: InstructionSet
    thread_size: int | None
    current: CurrentTask | None
    spaces: Spaces  # each process's, the kernel's (``kernel``: a kernel thread's)

    async def every_task(self, read: Reader) -> list[FoundTask]:
        """Every task but the idle ones, read through ``read`` (kernel memory, the guest
        stopped), by pid: the lists walked, then two reads for them all (each task's fields;
        then its leader's name, its kernel stack from its saved context up, its page tables'
        root)."""
        leaders = await task_list(read, self.init_task, self.tasks)
        every = await threads(read, leaders, self.layout)
        running = {} if self.current is None else await self.current.running(read)
        ranges = []
        for at in every:
            ranges += [
                task_range(at, self.tasks),
                self._saved(at),
                *self._switches(at),
            ]
        raw = await read(ranges)
        read_first = [self._first(at, raw[6 * i : 6 * i + 6]) for i, at in enumerate(every)]
        first = [(at, found) for at, found in zip(every, read_first, strict=True) if found]
        second = await read([r for at, found in first for r in self._second(found, at in running)])
        tables = self.spaces.tables
        walk = None
        if tables is not None:  # its entries and levels: arm64's are not x86_64's
            walk = tables.over(read)
        out = []
        for i, (at, (task, leader, version, saved)) in enumerate(first):
            more = second[3 * i : 3 * i + 3]
            task = task if leader is None else with_leader(task, more[0])
            letter, name = self.states.decode(*version[:2])
            space = await self.spaces.preload(read, task) or self.spaces.kernel
            found = FoundTask(
                task.process, letter, name, running.get(at), space, at=at, version=version
            )
            if more[1] is not None:
                found = self._stacks(found, task, saved, more[1], more[2], read, walk)
            out.append(found)
        return sorted(out, key=lambda t: (t.process.tid or 0) if t.process else 0)

    async def versions(self, read: Reader, tasks: Sequence[int]) -> list[tuple[int, ...] | None]:
        """What ``every_task`` read as each task's version (state, exit state, context-switch
        counts), read again; None for a task on a CPU now."""
        running = {} if self.current is None else await self.current.running(read)
        raw = await read([r for at in tasks for r in self._switches(at)])
        out: list[tuple[int, ...] | None] = []
        for i, at in enumerate(tasks):
            parts = raw[4 * i : 4 * i + 4]
            if at in running or any(part is None for part in parts):
                out.append(None)
            else:
                out.append(tuple(int.from_bytes(part or b"", "little") for part in parts))
        return out

    def _saved(self, at: int) -> tuple[int, int]:
        """Where its context switch left its registers."""
        offset, size = self.layout.switch.saved
        return at + offset, size

    def _switches(self, at: int) -> list[tuple[int, int]]:
        """Where a task's version lies: its state, exit state and context-switch counts."""
        layout = self.layout
        return [
            (at + layout.state, layout.state_size),
            (at + layout.exit_state, 4),
            (at + layout.nvcsw, 8),
            (at + layout.nivcsw, 8),
        ]

    def _first(
        self, at: int, raw: list[bytes | None]
    ) -> tuple[Task, int | None, tuple[int, ...], bytes] | None:
        """The task, the leader whose name it needs, its version (``versions``) and the
        registers its context switch saved."""
        if any(part is None for part in raw):
            return None
        fields, saved, *version = (part or b"" for part in raw)
        task, leader = parse_task(fields, at, self.tasks, self.arch.shared_from)
        numbers = tuple(int.from_bytes(part, "little") for part in version)
        return task, leader, numbers, saved

    def _second(
        self, found: tuple[Task, int | None, tuple[int, ...], bytes], on_cpu: bool
    ) -> list[tuple[int, int]]:
        """Its leader's name; off CPU, its kernel stack from the stack pointer it was switched
        out with to the stack's end (an exited task's stack is freed); its page tables' root
        (size 0: not wanted)."""
        task, leader, version, saved = found
        sp = self.layout.switch.stack_pointer(saved)
        exit_state = version[1]
        name = (0, 0) if leader is None else (leader + self.tasks.comm, self.tasks.comm_size)
        size, vmas = self.thread_size, self.spaces.vmas
        end = task.stack + (size or 0)
        stack = (0, 0)
        if not on_cpu and not exit_state and size and task.stack <= sp < end:
            stack = (sp, end - sp)
        pgd = (0, 0) if not task.mm or vmas is None else (task.mm + vmas.pgd, 8)
        return [name, stack, pgd]

    def _stacks(
        self,
        found: FoundTask,
        task: Task,
        saved: bytes,
        stack: bytes,
        pgd: bytes | None,
        read: Reader,
        walk: PageTables | None,
    ) -> FoundTask:
        switch = self.layout.switch
        sp = switch.stack_pointer(saved)
        kernel = switch.kernel_registers(saved, stack, sp, self.arch)
        window = (sp, stack)
        if not task.mm:
            return dataclasses.replace(found, kernel=kernel, read=read, window=window)
        user = switch.user_registers(stack, self.arch)
        root = None if pgd is None else int.from_bytes(pgd, "little")
        read_user = None if walk is None or root is None else walk.reader(root)
        both = split(read, read_user, self.arch.shared_from)
        return dataclasses.replace(found, kernel=kernel, user=user, read=both, window=window)
