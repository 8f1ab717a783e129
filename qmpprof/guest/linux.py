"""Processes of a stock Linux guest: each vCPU's current task, read from guest memory at the
offsets the kernel's own BTF gives (no table of versions).

The current task pointer is a per-CPU variable: ``pcpu_hot.current_task`` (6.2 on) or
``current_task``. A vCPU's per-CPU base is ``__per_cpu_offset[cpu]`` (kallsyms has it on
distribution kernels, CONFIG_KALLSYMS_ALL), read once; without that symbol, the GS base of a
sample taken in kernel mode. The pointer is read with the stack window (``reads_for``); the task
(pid, tgid, comm, flags, its thread group leader's comm) only when that pointer was not seen
within the last RECHECK seconds. A process is its tgid and its leader's comm; kernel threads are
named ``[comm]`` (``[kworker/0:1]``), the idle tasks ``swapper/N``. Kernel work done in a system
call belongs to the process that made it: the current task is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qmpprof.guest.base import Identity
from qmpprof.linux.btf import Btf
from qmpprof.memo import Memo
from qmpprof.memory import fetch
from qmpprof.model import Process, Registers
from qmpprof.pages import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import AddressSpace, Module

RECHECK = 0.5  # seconds a task pointer's identity is trusted without reading the task again
PF_KTHREAD = 0x0020_0000
_UPPER_HALF = 0xFFFF_8000_0000_0000
_TASKS_LIMIT = 4096
_COMM = 16  # TASK_COMM_LEN


@dataclass(frozen=True, slots=True)
class TaskLayout:
    """Byte offsets in ``struct task_struct``, and the per-CPU offset of the current task."""

    current: int
    pid: int
    tgid: int
    comm: int
    flags: int
    group_leader: int

    @classmethod
    def from_btf(cls, btf: Btf) -> TaskLayout:
        """Raises KeyError naming what this kernel's BTF lacks."""
        try:
            hot, _ = btf.percpu("pcpu_hot")
            current = hot + btf.offset_of("pcpu_hot.current_task")
        except KeyError:
            current, _ = btf.percpu("current_task")
        field = btf.offset_of
        return cls(
            current=current,
            pid=field("task_struct.pid"),
            tgid=field("task_struct.tgid"),
            comm=field("task_struct.comm"),
            flags=field("task_struct.flags"),
            group_leader=field("task_struct.group_leader"),
        )


@dataclass(frozen=True, slots=True)
class Task:
    pid: int
    tgid: int
    comm: str
    kernel_thread: bool
    leader_comm: str

    @property
    def process(self) -> Process:
        if self.pid == 0:
            return Process(0, self.comm, 0)  # swapper/N, the idle task of CPU N
        if self.kernel_thread:
            return Process(self.tgid, f"[{self.comm}]", 0)
        return Process(self.tgid, self.leader_comm, 0)


class LinuxIdentifier:
    """A GuestIdentifier for Linux guests. With no layout (a kernel without BTF) every sample
    is the kernel's, unnamed; stacks are walked all the same."""

    def __init__(
        self,
        kernel_modules: Sequence[Module],
        layout: TaskLayout | None,
        per_cpu_offset: int | None,
        *,
        recheck: float = RECHECK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``per_cpu_offset``: the runtime address of ``__per_cpu_offset`` (None: unknown)."""
        self.space = AddressSpace(kernel_modules)
        self.kernel = Identity(None, self.space)
        self.layout = layout
        self.per_cpu_offset = per_cpu_offset
        self.recheck = recheck
        self.clock = clock
        self._bases: dict[int, int] = {}  # vCPU -> its per-CPU base
        self._tasks: Memo[int, tuple[Identity, float]] = Memo(_TASKS_LIMIT)

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        base = self._bases.get(regs.cpu)
        if self.layout is None or base is None:
            return ()
        return ((base + self.layout.current, 8),)

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        layout = self.layout
        if layout is None:
            return self.kernel
        base = await self._base(transport, regs, cache)
        if base is None:
            return self.kernel
        addr = base + layout.current
        await fetch(transport, cache, regs.cpu, addr, 8)
        task = cache.read_u64(addr)
        if not task or task < _UPPER_HALF:
            return self.kernel
        seen = self._tasks.get(task)
        if seen is not None and self.clock() - seen[1] <= self.recheck:
            return seen[0]
        found = await self._read_task(transport, regs.cpu, task, layout)
        identity = self.kernel if found is None else Identity(found.process, self.space)
        self._tasks.put(task, (identity, self.clock()))
        return identity

    async def _base(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> int | None:
        base = self._bases.get(regs.cpu)
        if base is not None:
            return base
        if self.per_cpu_offset is not None:
            addr = self.per_cpu_offset + 8 * regs.cpu
            await fetch(transport, cache, regs.cpu, addr, 8)
            base = cache.read_u64(addr)
        elif regs.cpl == 0 and regs.gs_base >= _UPPER_HALF:
            base = regs.gs_base  # kernel mode after swapgs: the per-CPU base
        if base:
            self._bases[regs.cpu] = base
        return base or None

    async def _read_task(
        self, transport: GuestTransport, cpu: int, task: int, layout: TaskLayout
    ) -> Task | None:
        cache = PageCache()
        fields = ((layout.pid, 4), (layout.tgid, 4), (layout.comm, _COMM), (layout.flags, 4),
                  (layout.group_leader, 8))  # fmt: skip
        low = min(offset for offset, _ in fields)
        high = max(offset + size for offset, size in fields)
        await fetch(transport, cache, cpu, task + low, high - low)  # one read: 1-2 pages
        pid, tgid = _u32(cache, task + layout.pid), _u32(cache, task + layout.tgid)
        flags, comm = _u32(cache, task + layout.flags), _text(cache, task + layout.comm)
        leader = cache.read_u64(task + layout.group_leader)
        if pid is None or tgid is None or flags is None or comm is None:
            return None
        leader_comm = comm
        if leader and leader != task and leader >= _UPPER_HALF:
            await fetch(transport, cache, cpu, leader + layout.comm, _COMM)
            leader_comm = _text(cache, leader + layout.comm) or comm
        return Task(pid, tgid, comm, bool(flags & PF_KTHREAD), leader_comm)


def _u32(cache: PageCache, addr: int) -> int | None:
    data = cache.read(addr, 4)
    return None if data is None else int.from_bytes(data, "little")


def _text(cache: PageCache, addr: int) -> str | None:
    data = cache.read(addr, _COMM)
    return None if data is None else data.split(b"\0", 1)[0].decode("utf-8", "replace")
