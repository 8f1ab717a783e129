"""Processes of a stock Linux guest: each vCPU's current task, read from guest memory at the
offsets the kernel's own BTF gives (no table of versions).

The current task pointer is a per-CPU variable: ``pcpu_hot.current_task`` (6.2 on) or
``current_task``. A vCPU's per-CPU base is ``__per_cpu_offset[cpu]`` (kallsyms has it on
distribution kernels, CONFIG_KALLSYMS_ALL), read once; without that symbol, the GS base of a
sample taken in kernel mode. The pointer is read with the stack window (``reads_for``); the task
(pid, tgid, comm, flags, its thread group leader's comm) only when that pointer's fields were not
read or confirmed within the last RECHECK seconds: between samples, while the guest runs, the
tasks sampled lately are read again through the control channel (``housekeep``), so a pause
reads a task's fields the first time it meets the task, not every RECHECK. A stack belongs to
one task (a kernel stack; a user stack page under one CR3 to one thread): once the pointer said
whose stack RSP is on, samples on that stack page skip the pointer for RECHECK seconds too. A
process is its tgid and its leader's comm; kernel threads are named ``[comm]``
(``[kworker/0:1]``), the idle tasks ``swapper/N``. Kernel work done in a system call belongs to
the process that made it: the current task is the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qmpprof.guest.base import Identity
from qmpprof.guest.linuxmodules import ModuleList
from qmpprof.guest.linuxpages import PageTables
from qmpprof.guest.linuxvma import ReadMany, Vma, VmaLayout, read_exec_vmas
from qmpprof.guest.userfiles import UserFiles
from qmpprof.linux.btf import Btf
from qmpprof.memo import Memo
from qmpprof.memory import fetch_piece
from qmpprof.model import Mapping, Process, Registers
from qmpprof.pages import PAGE, PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import AddressSpace, Module

RECHECK = 0.5  # seconds a task pointer's identity is trusted without reading the task again
SPACE_RECHECK = 5.0  # seconds a process's mappings are trusted without reading them again
MODULES_RECHECK = 2.0  # seconds between two reads of the module list's links
SPACE_CONFIRM = 0.5  # seconds between two confirmations of a process's mappings, between samples
TASKS_CONFIRMED = 2  # task structs read again per housekeeping call, at most
_PROBE = 32  # bytes of code compared between a mapping and the file that claims it
PF_KTHREAD = 0x0020_0000
_UPPER_HALF = 0xFFFF_8000_0000_0000
_TASKS_LIMIT = 4096
_COMM = 16  # TASK_COMM_LEN
PER_CPU_AREA = 1 << 24  # a per-CPU variable's offset is below this (kallsyms' per-CPU addresses)
THREAD_SIZE = 16384  # x86_64's kernel stack (32 KiB with KASAN: then stacks are not learnt)


@dataclass(frozen=True, slots=True)
class TaskLayout:
    """Byte offsets in ``struct task_struct``, and the per-CPU offset of the current task."""

    current: int
    pid: int
    tgid: int
    comm: int
    flags: int
    group_leader: int
    mm: int
    tasks: int  # the list of every task, from init_task
    stack: int  # void *: the task's kernel stack (THREAD_SIZE bytes)

    @classmethod
    def from_btf(
        cls, btf: Btf, per_cpu_symbol: Callable[[str], int | None] = lambda name: None
    ) -> TaskLayout:
        """Raises KeyError naming what this kernel's BTF lacks. The current task's per-CPU
        offset comes from BTF's per-CPU variables, else from ``per_cpu_symbol`` (kallsyms: a
        per-CPU variable's address there is its offset in the per-CPU area), for kernels whose
        BTF has no variables (Debian's 5.10, built with an older pahole)."""
        field = btf.offset_of
        current = None
        for hot in (True, False):
            name = "pcpu_hot" if hot else "current_task"
            try:
                base, _ = btf.percpu(name)
            except KeyError:
                found = per_cpu_symbol(name)
                if found is None or found >= PER_CPU_AREA:
                    continue
                base = found
            current = base + field("pcpu_hot.current_task") if hot else base
            break
        if current is None:
            raise KeyError("the per-CPU variable current_task (in BTF or kallsyms)")
        return cls(
            current=current,
            pid=field("task_struct.pid"),
            tgid=field("task_struct.tgid"),
            comm=field("task_struct.comm"),
            flags=field("task_struct.flags"),
            group_leader=field("task_struct.group_leader"),
            mm=field("task_struct.mm"),
            tasks=field("task_struct.tasks"),
            stack=field("task_struct.stack"),
        )


@dataclass(frozen=True, slots=True)
class _Seen:
    """A task pointer's identity, from its fields (``task``, None when they did not read) as
    read or confirmed unchanged at ``checked``, and its kernel stack's lowest address."""

    identity: Identity
    checked: float
    task: Task | None
    stack: int


@dataclass(frozen=True, slots=True)
class _Placed:
    """A process's address space as built from its mappings (``vmas``), read or confirmed
    unchanged at ``checked``."""

    space: AddressSpace
    checked: float
    vmas: tuple[Vma, ...]


@dataclass(frozen=True, slots=True)
class Task:
    pid: int
    tgid: int
    comm: str
    kernel_thread: bool
    leader_comm: str
    mm: int  # its address space (struct mm_struct *), 0 for kernel threads
    stack: int  # its kernel stack's lowest address

    @property
    def process(self) -> Process:
        """The process (tgid, leader's comm) and this thread (pid, comm)."""
        if self.pid == 0:
            return Process(0, self.comm, 0, 0, self.comm)  # swapper/N, the idle task of CPU N
        if self.kernel_thread:
            return Process(self.tgid, f"[{self.comm}]", 0, self.pid, self.comm)
        return Process(self.tgid, self.leader_comm, 0, self.pid, self.comm)


class LinuxIdentifier:
    """A GuestIdentifier for Linux guests. With no layout (a kernel without BTF) every sample
    is the kernel's, unnamed; stacks are walked all the same."""

    def __init__(
        self,
        kernel_modules: Sequence[Module],
        layout: TaskLayout | None,
        per_cpu_offset: int | None,
        *,
        vmas: VmaLayout | None = None,
        files: UserFiles | None = None,
        module_list: ModuleList | None = None,
        control: GuestTransport | None = None,
        tables: PageTables | None = None,
        thread_size: int = THREAD_SIZE,
        recheck: float = RECHECK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``kernel_modules``: the kernel image's Module, then the loaded modules'.
        ``per_cpu_offset``: the runtime address of ``__per_cpu_offset`` (None: unknown).
        ``vmas``: how to read a process's mappings (None: user code is not placed); ``files``:
        where its ELF files are. ``module_list``: the guest's module list, and ``control``, a
        transport that reads kernel memory while the guest runs, for ``housekeep``;
        ``tables``, how to read a process's memory through its own page tables with it (so
        that ``preload`` places processes' code before the first stop)."""
        self.vmas = vmas
        self.files = files or UserFiles(None)
        self.module_list = module_list
        self.control = control
        self.tables = tables
        self.thread_size = thread_size
        self._modules_read = self._spaces_read = clock()
        self._use_modules(kernel_modules)
        self.layout = layout
        self.per_cpu_offset = per_cpu_offset
        self.recheck = recheck
        self.clock = clock
        self._bases: dict[int, int] = {}  # vCPU -> its per-CPU base

    def _use_modules(self, kernel_modules: Sequence[Module]) -> None:
        """Start over with these kernel modules: every process's space is built again."""
        self.kernel_modules = tuple(kernel_modules)
        self.space = AddressSpace(kernel_modules)
        self.kernel = Identity(None, self.space)
        # (mm, tgid) -> its space, when its mappings were last read or confirmed, and them.
        self._spaces: Memo[tuple[int, int], _Placed] = Memo(_TASKS_LIMIT)
        self._used: Memo[tuple[int, int], float] = Memo(_TASKS_LIMIT)  # when a sample last did
        # task pointer -> its identity as last read or confirmed; when a sample last used it
        self._tasks: Memo[int, _Seen] = Memo(_TASKS_LIMIT)
        self._tasks_used: Memo[int, float] = Memo(_TASKS_LIMIT)
        # (0 or CR3, stack page) -> the task whose stack it is, when the pointer said so
        self._owners: Memo[tuple[int, int], tuple[int, float]] = Memo(_TASKS_LIMIT)

    async def housekeep(self) -> None:
        """Between samples, while the guest runs: every MODULES_RECHECK seconds, read the
        module list again (its links; new modules in full) and take in what was loaded or
        unloaded since; and every SPACE_CONFIRM seconds, read the mappings of the process whose
        were read longest ago (of those sampled lately) from kernel memory: unchanged, they are
        trusted again, so no pause has to read them; changed, the next sample of it reads them
        (its code must be compared with the files under its own page tables)."""
        now = self.clock()
        if self.module_list is not None and now - self._modules_read >= MODULES_RECHECK:
            self._modules_read = now
            found = await self.module_list.refresh()
            if found is not None:
                self._use_modules([self.kernel_modules[0], *found])
        control, vmas = self.control, self.vmas
        if control is not None and self.layout is not None:
            await self._confirm_tasks(control, self.layout, now)
        if control is not None and vmas is not None and now - self._spaces_read >= SPACE_CONFIRM:
            self._spaces_read = now
            await self._confirm_space(control, vmas, now)

    async def _confirm_tasks(self, control: GuestTransport, layout: TaskLayout, now: float) -> None:
        """Read again the fields of the tasks samples used lately whose identity is 3/4 of its
        ``recheck`` old: unchanged, it is trusted for another ``recheck`` seconds, so no pause
        has to read them; changed (the pointer now holds another task, an exec renamed it),
        the next sample of it reads them."""
        due = sorted(
            (seen.checked, task)
            for task, seen in self._tasks.items()
            if now - seen.checked >= self.recheck * 0.75
            and now - self._tasks_used.get(task, 0.0) <= 2 * self.recheck
        )
        for _, task in due[:TASKS_CONFIRMED]:
            seen = self._tasks[task]
            found = await self._read_task(control, 0, task, layout)
            if self._tasks.get(task) is not seen:
                continue  # read again by a sample meanwhile, or started over
            if found == seen.task:
                self._tasks[task] = dataclasses.replace(seen, checked=now)
            else:
                del self._tasks[task]

    async def _confirm_space(self, control: GuestTransport, vmas: VmaLayout, now: float) -> None:
        due = [
            (placed.checked, key)
            for key, placed in self._spaces.items()
            if now - placed.checked >= SPACE_RECHECK / 2
            and now - self._used.get(key, 0.0) <= 2 * SPACE_RECHECK
        ]
        if not due:
            return
        _, key = min(due)
        placed = self._spaces[key]
        found = tuple(await read_exec_vmas(reader_of(control, 0), key[0], vmas))
        if self._spaces.get(key) is not placed:
            return  # read again meanwhile, or started over
        if found == placed.vmas:
            self._spaces[key] = dataclasses.replace(placed, checked=self.clock())
        else:
            del self._spaces[key]

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        base = self._bases.get(regs.cpu)
        if self.layout is None or base is None or self._owner(regs) is not None:
            return ()
        return ((base + self.layout.current, 8),)

    def _owner(self, regs: Registers) -> int | None:
        """The task whose stack RSP is on, when the current task's pointer said so within
        ``recheck`` seconds (a kernel stack belongs to one task, a user stack page under one
        CR3 to one thread): then the pointer need not be read."""
        owned = self._owners.get(_stack_page(regs))
        if owned is None or self.clock() - owned[1] > self.recheck:
            return None
        return owned[0]

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        layout = self.layout
        if layout is None:
            return self.kernel
        task = self._owner(regs)
        pointer_read = task is None
        if task is None:
            base = await self._base(transport, regs, cache)
            if base is None:
                return self.kernel
            addr = base + layout.current
            await fetch_piece(transport, cache, regs.cpu, addr, 8)
            task = cache.read_u64(addr)
            if not task or task < _UPPER_HALF:
                return self.kernel
        now = self.clock()
        self._tasks_used.put(task, now)
        seen = self._tasks.get(task)
        if seen is not None and now - seen.checked <= self.recheck:
            identity, stack = seen.identity, seen.stack
        else:
            found = await self._read_task(transport, regs.cpu, task, layout)
            if found is None:
                identity, stack = self.kernel, 0
            else:
                space = await self._space_of(transport, regs.cpu, found)
                identity, stack = Identity(found.process, space), found.stack
            self._tasks.put(task, _Seen(identity, now, found, stack))
        user = regs.cpl == 3
        on_own_stack = user or (stack != 0 and stack <= regs.rsp < stack + self.thread_size)
        if pointer_read and identity is not self.kernel and on_own_stack:
            self._owners.put(_stack_page(regs), (task, self.clock()))
        return identity

    async def _base(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> int | None:
        base = self._bases.get(regs.cpu)
        if base is not None:
            return base
        if self.per_cpu_offset is not None:
            addr = self.per_cpu_offset + 8 * regs.cpu
            await fetch_piece(transport, cache, regs.cpu, addr, 8)
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
                  (layout.group_leader, 8), (layout.mm, 8), (layout.stack, 8))  # fmt: skip
        low = min(offset for offset, _ in fields)
        high = max(offset + size for offset, size in fields)
        await fetch_piece(transport, cache, cpu, task + low, high - low)  # one read
        pid, tgid = _u32(cache, task + layout.pid), _u32(cache, task + layout.tgid)
        flags, comm = _u32(cache, task + layout.flags), _text(cache, task + layout.comm)
        leader = cache.read_u64(task + layout.group_leader)
        mm = cache.read_u64(task + layout.mm) or 0
        stack = cache.read_u64(task + layout.stack) or 0
        if pid is None or tgid is None or flags is None or comm is None:
            return None
        leader_comm = comm
        if leader and leader != task and leader >= _UPPER_HALF:
            await fetch_piece(transport, cache, cpu, leader + layout.comm, _COMM)
            leader_comm = _text(cache, leader + layout.comm) or comm
        kernel_thread = bool(flags & PF_KTHREAD)
        return Task(pid, tgid, comm, kernel_thread, leader_comm, 0 if kernel_thread else mm, stack)

    async def preload(
        self, control: GuestTransport, init_task: int, cpus: Sequence[int] = ()
    ) -> int:
        """Before the first stop, through ``control`` (which reads kernel memory while the
        guest runs): the per-CPU bases of ``cpus``, and every task on the task list from
        ``init_task``: its identity, and for each process its mappings and ELF files, placed
        where the process's page tables say its code is (with ``tables``; else the ELF files
        are loaded, to be placed by the first sample of the process). So a first sample reads
        what a steady one does, and no file. Returns how many processes were looked at."""
        layout = self.layout
        if layout is None:
            return 0
        read = reader_of(control, 0)
        if self.per_cpu_offset is not None:
            found = await read([(self.per_cpu_offset + 8 * cpu, 8) for cpu in cpus])
            for cpu, raw in zip(cpus, found, strict=True):
                base = 0 if raw is None else int.from_bytes(raw, "little")
                if base:
                    self._bases[cpu] = base
        seen = 0
        node = await _next(read, init_task + layout.tasks)
        visited = {init_task + layout.tasks}
        while node is not None and node not in visited and len(visited) <= _TASKS_LIMIT:
            visited.add(node)
            at = node - layout.tasks
            task = await self._read_task(control, 0, at, layout)
            identity = self.kernel if task is None else await self._preload_task(control, task)
            if identity is not None:
                self._tasks.put(
                    at, _Seen(identity, self.clock(), task, 0 if task is None else task.stack)
                )
            seen += task is not None and bool(task.mm) and task.pid == task.tgid
            node = await _next(read, node)
        if self.tables is not None:
            self.tables.forget()
        return seen

    async def _preload_task(self, control: GuestTransport, task: Task) -> Identity | None:
        """A task's identity, its process's space placed (None: it cannot be placed before a
        sample of it, which then reads the task again)."""
        if self.vmas is None or not task.mm:
            return Identity(task.process, self.space)
        key = (task.mm, task.tgid)
        placed = self._spaces.get(key)
        if placed is not None:
            return Identity(task.process, placed.space)
        read = reader_of(control, 0)
        vmas = tuple(await read_exec_vmas(read, task.mm, self.vmas))
        for vma in vmas:
            for image in self.files.candidates(vma.name) if vma.name else ():
                image.prepare()
        if self.tables is None:
            return None
        (raw,) = await read([(task.mm + self.vmas.pgd, 8)])
        if raw is None:
            return None
        user = await user_modules(
            self.tables.reader(int.from_bytes(raw, "little")), vmas, self.files
        )
        space = AddressSpace([*self.kernel_modules, *user]) if user else self.space
        self._spaces.put(key, _Placed(space, self.clock(), vmas))
        return Identity(task.process, space)

    async def _space_of(self, transport: GuestTransport, cpu: int, task: Task) -> AddressSpace:
        """The kernel's modules and the process's executable mappings (kept for SPACE_RECHECK
        seconds per address space)."""
        if self.vmas is None or not task.mm:
            return self.space
        key = (task.mm, task.tgid)
        self._used.put(key, self.clock())
        seen = self._spaces.get(key)
        if seen is not None and self.clock() - seen.checked <= SPACE_RECHECK:
            return seen.space
        read = reader_of(transport, cpu)
        vmas = tuple(await read_exec_vmas(read, task.mm, self.vmas))
        user = await user_modules(read, vmas, self.files)
        space = AddressSpace([*self.kernel_modules, *user]) if user else self.space
        self._spaces.put(key, _Placed(space, self.clock(), vmas))
        return space


async def user_modules(read: ReadMany, vmas: Sequence[Vma], files: UserFiles) -> list[Module]:
    """A Module per mapped file (an ELF from ``files`` at its load bias, when one matches the
    guest's bytes) and per anonymous executable mapping (frame pointers, named by mapping)."""
    codes = await read([(v.start, _PROBE) for v in vmas])
    modules: list[Module] = []
    placed: set[str] = set()
    for vma, code in zip(vmas, codes, strict=True):
        offset = vma.pgoff * PAGE
        image = None if vma.name is None else files.match(vma.name, offset, code)
        if image is not None:
            if image.path not in placed:
                placed.add(image.path)
                bias = vma.start - offset - (image.load_range[0] - image.load_offset)
                modules.append(Module.from_image(image, kernel=False, bias=bias))
            continue
        name = f"[{vma.name or 'anon'}]"
        modules.append(Module(Mapping(name, vma.start, vma.end, False, file_offset=offset)))
    return _disjoint(modules)


def _disjoint(modules: list[Module]) -> list[Module]:
    """Modules by start, each cut short of the next (an ELF's range spans its data segments,
    which other mappings may follow closely)."""
    ordered = sorted(modules, key=lambda m: m.start)
    out = []
    for module, following in zip(ordered, [*ordered[1:], None][: len(ordered)], strict=True):
        if following is not None and module.end > following.start:
            mapping = dataclasses.replace(module.mapping, end=following.start)
            module = dataclasses.replace(module, mapping=mapping)
        out.append(module)
    return out


def reader_of(transport: GuestTransport, cpu: int) -> ReadMany:
    """Reads of several ranges as ``cpu`` sees memory, issued together (None: unreadable)."""

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        cache = PageCache()
        await asyncio.gather(
            *(fetch_piece(transport, cache, cpu, a, n) for a, n in ranges if n > 0)
        )
        return [cache.read(a, n) if n > 0 else None for a, n in ranges]

    return read


async def _next(read: ReadMany, node: int) -> int | None:
    (raw,) = await read([(node, 8)])
    return None if raw is None else int.from_bytes(raw, "little")


def _stack_page(regs: Registers) -> tuple[int, int]:
    # Kernel stacks look the same under every CR3; a user stack page belongs to its CR3.
    return (regs.cr3 if regs.cpl == 3 else 0, regs.rsp >> 12)


def _u32(cache: PageCache, addr: int) -> int | None:
    data = cache.read(addr, 4)
    return None if data is None else int.from_bytes(data, "little")


def _text(cache: PageCache, addr: int) -> str | None:
    data = cache.read(addr, _COMM)
    return None if data is None else data.split(b"\0", 1)[0].decode("utf-8", "replace")
