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

A task off CPU resumes where its context switch left it: ``thread.sp`` points at the
``inactive_task_frame`` it pushed (its frame pointer and the return address into the
scheduler), and its kernel stack goes on above that frame. A task with a process beneath it
entered the kernel from user mode: its user registers are the ``pt_regs`` at the top of its
kernel stack.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.guest.base import FoundTask
from qmpprof.guest.linux.current import CurrentTask
from qmpprof.guest.linux.pagetables import PageTables
from qmpprof.guest.linux.spaces import Spaces
from qmpprof.guest.linux.tasks import Task, TaskLayout, read_task, task_list
from qmpprof.linux.btf import Btf
from qmpprof.memory import Reader, read_ints, read_one
from qmpprof.model import Registers

# TASK_NOLOAD (include/linux/sched.h: 0x400 in 5.10, 6.1, 6.12 and 7.2): with
# TASK_UNINTERRUPTIBLE it makes TASK_IDLE, which /proc reports as the array's last entry.
TASK_NOLOAD = 0x400
# What lies above pt_regs at the top of a kernel stack (TOP_OF_KERNEL_STACK_PADDING, x86_64):
# nothing, or 16 bytes on kernels built with CONFIG_X86_FRED (6.9 and later); the pt_regs whose
# code and stack segments are user ones (privilege level 3) is taken.
STACK_PADDINGS = (0, 16)
_STATE_TEXT = re.compile(rb"(\S) \(([^)]+)\)\0")
_MAX_STATES = 16
_MAX_THREADS = 4096


@dataclass(frozen=True, slots=True)
class OffCpuLayout:
    """Byte offsets of what a task off CPU leaves behind, and the sizes around them."""

    state: int
    state_size: int  # 8 for 5.10's long state, 4 for __state
    exit_state: int
    thread_sp: int  # task_struct.thread.sp
    signal: int
    thread_node: int
    thread_head: int  # signal_struct.thread_head
    frame_size: int  # struct inactive_task_frame
    frame_bp: int
    frame_ret: int
    regs_size: int  # struct pt_regs
    regs: tuple[tuple[str, int], ...]  # registers in pt_regs: the instruction set's name, offset

    @classmethod
    def from_btf(cls, btf: Btf, arch: InstructionSet) -> OffCpuLayout:
        """Raises KeyError naming what this kernel's BTF lacks. ``pt_regs`` names x86_64's
        registers without their "r" ("ip", "bx"; but "r8"), its segments "cs" and "ss"."""
        try:
            state = btf.field("task_struct.__state")
        except KeyError:
            state = btf.field("task_struct.state")
        frame = btf.find("inactive_task_frame")
        regs = btf.find("pt_regs")
        if frame is None or regs is None:
            raise KeyError("inactive_task_frame or pt_regs")
        return cls(
            state=state.offset,
            state_size=btf.size_of(state.type_id),
            exit_state=btf.offset_of("task_struct.exit_state"),
            thread_sp=btf.offset_of("task_struct.thread") + btf.offset_of("thread_struct.sp"),
            signal=btf.offset_of("task_struct.signal"),
            thread_node=btf.offset_of("task_struct.thread_node"),
            thread_head=btf.offset_of("signal_struct.thread_head"),
            frame_size=btf.size_of(frame),
            frame_bp=btf.offset_of("inactive_task_frame.bp"),
            frame_ret=btf.offset_of("inactive_task_frame.ret_addr"),
            regs_size=btf.size_of(regs),
            regs=tuple(_pt_regs(btf, (*arch.names, "cs", "ss"))),
        )


def _pt_regs(btf: Btf, names: Sequence[str]) -> list[tuple[str, int]]:
    out = []
    for name in names:
        for member in (name, name[1:]):
            try:
                out.append((name, btf.offset_of(f"pt_regs.{member}")))
                break
            except KeyError:
                continue
    found = {name for name, _ in out}
    if not {"cs", "ss"} <= found:
        raise KeyError("pt_regs.cs, pt_regs.ss")
    return out


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


@dataclass(frozen=True, slots=True)
class Waiting:
    """What a task left behind: its state values, and where its kernel stack resumes."""

    state: int
    exit_state: int
    sp: int  # thread.sp: its inactive_task_frame


async def threads(read: Reader, leaders: Sequence[int], layout: OffCpuLayout) -> list[int]:
    """Every thread of the processes whose leaders are ``leaders``, each leader first."""
    out: list[int] = []
    signals = await read_ints(read, [(task + layout.signal, 8) for task in leaders])
    for leader, signal in zip(leaders, signals, strict=True):
        out.append(leader)
        if not signal:
            continue
        head = signal + layout.thread_head
        (node,) = await read_ints(read, [(head, 8)])
        seen = {head}
        while node is not None and node not in seen and len(seen) <= _MAX_THREADS:
            seen.add(node)
            task = node - layout.thread_node
            if task != leader:
                out.append(task)
            (node,) = await read_ints(read, [(node, 8)])
    return out


async def waiting(read: Reader, task: int, layout: OffCpuLayout) -> Waiting | None:
    found = await read_ints(
        read,
        [
            (task + layout.state, layout.state_size),
            (task + layout.exit_state, 4),
            (task + layout.thread_sp, 8),
        ],
    )
    state, exit_state, sp = found
    if state is None or exit_state is None or sp is None:
        return None
    return Waiting(state, exit_state, sp)


async def kernel_registers(
    read: Reader, sp: int, layout: OffCpuLayout, arch: InstructionSet
) -> Registers | None:
    """Where a task off CPU resumes in the kernel: the return address its context switch
    pushed, the frame pointer it saved, its stack above that frame (as the kernel's own ORC
    unwinder starts on a blocked task, ``__unwind_start``)."""
    raw = await read_one(read, sp, layout.frame_size)
    if raw is None:
        return None
    ret = int.from_bytes(raw[layout.frame_ret : layout.frame_ret + 8], "little")
    bp = int.from_bytes(raw[layout.frame_bp : layout.frame_bp + 8], "little")
    if ret < arch.shared_from:
        return None
    return Registers(0, arch.name, ret, sp + layout.frame_size, bp, False, 0)


async def user_registers(
    read: Reader, stack: int, thread_size: int, layout: OffCpuLayout, arch: InstructionSet
) -> Registers | None:
    """The user registers a task entered the kernel with: the ``pt_regs`` at the top of its
    kernel stack (``stack``: the stack's lowest address)."""
    padding = max(STACK_PADDINGS)
    at = stack + thread_size - padding - layout.regs_size
    raw = await read_one(read, at, layout.regs_size + padding)
    if raw is None:
        return None
    offsets = dict(layout.regs)
    for pad in STACK_PADDINGS:
        base = padding - pad

        def value(name: str, base: int = base) -> int:
            offset = base + offsets[name]
            return int.from_bytes(raw[offset : offset + 8], "little")

        if value("cs") & 3 == 3 and value("ss") & 3 == 3:
            gprs = {n: value(name) for n, name in enumerate(arch.names) if name in offsets}
            pc, sp, fp = gprs.get(arch.pc, 0), gprs.get(arch.sp, 0), gprs.get(arch.fp, 0)
            return Registers(0, arch.name, pc, sp, fp, True, 0, gprs=gprs)
    return None


@dataclass(frozen=True, slots=True)
class Census:
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
        stopped), by pid."""
        leaders = await task_list(read, self.init_task, self.tasks)
        running = {} if self.current is None else await self.current.running(read)
        tables = self.spaces.tables
        walk = None if tables is None else PageTables(read, tables.direct_map, tables.levels)
        out = []
        for at in await threads(read, leaders, self.layout):
            task = await read_task(read, at, self.tasks, self.arch.shared_from)
            left = await waiting(read, at, self.layout)
            if task is None or left is None:
                continue
            letter, name = self.states.decode(left.state, left.exit_state)
            space = await self.spaces.preload(read, task) or self.spaces.kernel
            found = FoundTask(task.process, letter, name, running.get(at), space)
            if found.cpu is None and not left.exit_state:  # an exited task's stack is freed
                found = await self._stacks(read, found, task, left, walk)
            out.append(found)
        return sorted(out, key=lambda t: (t.process.tid or 0) if t.process else 0)

    async def _stacks(
        self, read: Reader, found: FoundTask, task: Task, left: Waiting, walk: PageTables | None
    ) -> FoundTask:
        kernel = await kernel_registers(read, left.sp, self.layout, self.arch)
        if not task.mm or self.thread_size is None or not task.stack:
            return dataclasses.replace(found, kernel=kernel, read=read)
        user = await user_registers(read, task.stack, self.thread_size, self.layout, self.arch)
        read_user = None
        if walk is not None and self.spaces.vmas is not None:
            (pgd,) = await read_ints(read, [(task.mm + self.spaces.vmas.pgd, 8)])
            read_user = None if pgd is None else walk.reader(pgd)
        both = _split(read, read_user, self.arch.shared_from)
        return dataclasses.replace(found, kernel=kernel, user=user, read=both)


def _split(kernel: Reader, user: Reader | None, shared_from: int) -> Reader:
    """Reads of a task's memory: the kernel's half through ``kernel``, the rest through
    ``user`` (its page tables; None: unreadable)."""

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        high = [r for r in ranges if r[0] >= shared_from]
        low = [r for r in ranges if r[0] < shared_from]
        found_high = iter(await kernel(high) if high else [])
        found_low = iter(await user(low) if low and user is not None else [None] * len(low))
        return [next(found_high) if r[0] >= shared_from else next(found_low) for r in ranges]

    return read
