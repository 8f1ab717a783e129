"""Who runs on a vCPU of a running Linux guest, put together from its parts: the kernel's
modules (``modules.ModuleList`` looked at again between ticks), each vCPU's current task
(``current``), what was read of each task (``tasks``) and the processes' address spaces
(``spaces``). A task's kernel work belongs to the process it serves: the current task is the
same during a system call.

In a pause, the current task's pointer and the stamp of the task expected (the owner of the
stack page, else the vCPU's last task) are read with the stack window: when the pointer holds
the expected task and its stamp is the one read before, nothing more is read; in kernel mode
another task known before has its stamp read then; a stamp that changed (an exec, a task_struct
reused) has the task read again in the pause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Sequence

from qmpprof.arch.base import InstructionSet
from qmpprof.guest.base import Identity
from qmpprof.guest.firmware import Firmware
from qmpprof.linux.running.current import CurrentTask
from qmpprof.linux.running.kernelmemory import KernelTables, beyond_user_mode
from qmpprof.linux.running.linearmap import LinearMap, linear_reader
from qmpprof.linux.running.modules import ModuleList
from qmpprof.linux.running.pagetables import PageTables, holds, split
from qmpprof.linux.running.spaces import Spaces
from qmpprof.linux.running.tasks import RECHECK, Stamp, Task, TaskLayout, Tasks, read_task
from qmpprof.memory import Reader, held, read_one, reader
from qmpprof.model import Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import AddressSpace, Module
from qmpprof.unwind.steps import ExceptionEntry

MODULES_RECHECK = 2.0  # seconds between two reads of the module list's links
MODULES_RETRY = 1.0  # seconds between two tries, in a pause, of a list not wholly read
# Seconds between two confirmations of the tasks sampled lately: an exec or a reused task is
# seen in the pause by its stamp; this catches a rename (prctl PR_SET_NAME).
TASKS_CONFIRM_EVERY = 0.2
# Seconds the page-table pages a kernel-mode sample's user memory is read through (arm64:
# every such sample) are kept, as guesses: each entry one gives is read again with the data it
# led to (``PageTables.reader``), so keeping them longer only holds more memory.
TABLES_KEPT = 10.0
# Housekeeping calls that may measure the linear map attach could not, once a vCPU's per-CPU
# base is known (each a pass over the vCPUs' registers and QEMU's translations).
LINEAR_TRIES = 8


class LinuxIdentifier:
    """Tells who runs on a vCPU. Without a task layout or a current task (a kernel without
    BTF) every sample is the kernel's, unnamed; stacks are walked all the same."""

    def __init__(
        self,
        kernel_modules: Sequence[Module],
        arch: InstructionSet,
        *,
        layout: TaskLayout | None = None,
        current: CurrentTask | None = None,
        spaces: Spaces | None = None,
        module_list: ModuleList | None = None,
        control: GuestTransport | None = None,
        thread_size: int | None = None,
        linear: LinearMap | None = None,
        find_linear: Callable[[], Awaitable[LinearMap | None]] | None = None,
        cpus: Sequence[int] = (0,),
        clock: Callable[[], float] = time.monotonic,
        recheck: float = RECHECK,
        entry: ExceptionEntry | None = None,
        kernel_tables: KernelTables | None = None,
    ) -> None:
        """``kernel_modules``: the kernel image's Module, then the loaded modules'.
        ``control``: a transport that reads kernel memory while the guest runs, for
        ``housekeep``. ``thread_size``: a task's kernel stack size (None: not known, then only
        user stacks are learnt as a task's). ``linear``: the kernel's linear map, read
        physically for a user-mode sample when the vCPU's own translation hides the kernel.
        ``find_linear``: measures the linear map between samples, when attach could not (no
        vCPU was in kernel mode then, or no per-CPU base was known). ``cpus``: the vCPUs
        ``control`` reads kernel memory through, in turn. ``entry``: the image's exception
        code, whose samples at an exception's entry need the exception link register.
        ``kernel_tables``: the kernel's own tables, for what between samples no vCPU and no
        linear map reads (vmalloc'd memory while each vCPU is in user mode)."""
        self.arch = arch
        self.entry = entry
        self.layout = layout
        self.current = current
        self.spaces = spaces
        self.module_list = module_list
        self.control = control
        self.thread_size = thread_size
        self.linear = linear
        self.kernel_tables = kernel_tables
        self.find_linear = find_linear
        self._linear_tries = 0
        self.cpus = cpus
        self._tables: dict[int, bytes | None] = {}  # page-table pages, kept as guesses
        self._tables_read = clock()
        # Whether user-mode vCPUs were seen unable to read the kernel (then read physically)
        self.hidden = False
        self.clock = clock
        self.tasks = Tasks(clock, recheck)
        self._last: dict[int, int] = {}  # vCPU -> the task it ran at its last sample
        self.firmware = Firmware((), arch)  # a vCPU that translates nothing runs the firmware
        self._modules_read = clock()
        self._modules_tried = -MODULES_RETRY  # never: the first kernel-mode sample may try
        self._modules_lock = asyncio.Lock()
        self._tasks_confirmed = clock()
        self.use_modules(kernel_modules)

    def use_modules(self, kernel_modules: Sequence[Module]) -> None:
        """Start over with these kernel modules: every process's space is built again."""
        self.kernel_modules = tuple(kernel_modules)
        self.space = AddressSpace(kernel_modules)
        self.kernel = Identity(None, self.space)  # the kernel's own: no process
        if self.spaces is not None:
            self.spaces.start_over(self.space)
        self.tasks.forget()

    async def preload(self, read: Reader, tasks: Sequence[int]) -> None:
        """Before the first stop, through ``read`` (kernel memory, while the guest runs): the
        identity of each task at ``tasks``, and each process's space placed where its page
        tables say its code is, so that a first sample reads what a steady one does."""
        if self.layout is None:
            return
        for at in tasks:
            task = await read_task(read, at, self.layout, self.arch.shared_from)
            if task is None:  # being made or torn down: a sample of it reads it again
                continue
            space = self.space if self.spaces is None else await self.spaces.preload(read, task)
            if space is not None:
                self.tasks.put(at, task, Identity(task.process, space))
        if self.spaces is not None and self.spaces.tables is not None:
            self.spaces.tables.forget()

    async def housekeep(self) -> None:
        """Between samples, while the guest runs, one job a call, each on its own schedule, so
        that no call keeps the next tick waiting long: the linear map, until measured (up to
        LINEAR_TRIES times), when attach could not; every MODULES_RECHECK seconds, read the
        module list again (its links; new modules in full) and take in what was loaded or
        unloaded since; read the files a pause met; confirm one process's mappings; every
        TASKS_CONFIRM_EVERY seconds, the tasks sampled lately."""
        if self.linear is None and self.find_linear is not None and self._bases_known():
            self.linear = await self.find_linear()
            self._linear_tries += 1
            if self.linear is not None or self._linear_tries >= LINEAR_TRIES:
                self.find_linear = None
            return
        now = self.clock()
        if self.module_list is not None and now - self._modules_read >= MODULES_RECHECK:
            self._modules_read = now
            found = await self.module_list.refresh()
            if found is not None:
                self.use_modules([self.kernel_modules[0], *found])
            return
        if self.control is None:
            return
        read = self.kernel_memory()
        if self.spaces is not None and (
            await self.spaces.settle(read) or await self.spaces.confirm(read)
        ):
            return
        if self.layout is not None and now - self._tasks_confirmed >= TASKS_CONFIRM_EVERY:
            self._tasks_confirmed = now
            await self.tasks.confirm(read, self.layout, self.arch.shared_from)

    def kernel_memory(
        self, transport: GuestTransport | None = None, cpus: Sequence[int] | None = None
    ) -> Reader:
        """Kernel memory whatever mode the vCPUs are in at each read: through them, else
        physically (a name read while each was at EL0 under arm64's KPTI failed, and a
        library's mapping went unnamed for seconds: 16 samples of xz's libc in ``[anon]``).
        Through ``control`` and ``cpus`` unless given others."""
        transport = self.control if transport is None else transport
        assert transport is not None
        cpus = self.cpus if cpus is None else cpus
        return beyond_user_mode(transport, cpus, self.linear, self.kernel_tables)

    def _bases_known(self) -> bool:
        """Whether the linear map can be measured: a vCPU's per-CPU base known (its current-task
        slot measures the map), or no slot needed (riscv64: the task in a register, the map in
        a kernel variable, read through a vCPU in the kernel)."""
        return self.current is not None and (bool(self.current.bases) or not self.current.per_cpu)

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        if self.current is None or (regs.user and self.hidden) or self.firmware.runs(regs):
            return ()  # not through the vCPU (identify reads them physically)
        pointer = self.current.reads_for(regs)
        held = self.current.held(regs)  # riscv64's tp: the task itself, its stamp read with it
        expected = held or self.current.owner(regs) or self._last.get(regs.cpu)
        if (not pointer and held is None) or expected is None or self.layout is None:
            return pointer
        return (*pointer, self.layout.stamp_range(expected))

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        if self.firmware.runs(regs):
            return await self._in_firmware(transport, regs, cache)
        if self.module_list is not None and not self.module_list.read_whole and not regs.user:
            await self._read_modules(self.module_list)
        regs = await self._with_wanted(transport, regs)
        identity = await self._identify(transport, regs, cache)
        linked = await self._exception_link(transport, regs)
        return identity if linked is None else dataclasses.replace(identity, registers=linked)

    async def _in_firmware(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        """A vCPU in the firmware (riscv64's M-mode: OpenSBI, emulating what the CPU traps on,
        such as a misaligned load): one ``[firmware]`` frame, under the process whose user code
        it was entered from (``special["user_pc"]``: riscv64's mepc, where mstatus.MPP says user
        mode; that process's task is in the registers as in user mode), else under no process."""
        firmware = self.firmware.identity(regs)
        user_pc = regs.special.get("user_pc")
        if user_pc is None or self.current is None:
            return firmware
        gprs = {**regs.gprs, self.arch.pc: user_pc}
        entered = dataclasses.replace(regs, pc=user_pc, user=True, gprs=gprs)
        entered = await self._with_wanted(transport, entered)
        process = (await self._identify(transport, entered, cache)).process
        return dataclasses.replace(firmware, process=process)

    async def _with_wanted(self, transport: GuestTransport, regs: Registers) -> Registers:
        """``regs`` with the system registers the current task is in where the sample did not
        read them (riscv64's sscratch over a transport that reads it apart), read now."""
        wanted = () if self.current is None else self.current.wants(regs)
        if not wanted:
            return regs
        found = await transport.system_registers(regs.cpu, wanted)
        return dataclasses.replace(regs, special={**regs.special, **found})

    async def _read_modules(self, modules: ModuleList) -> None:
        """The module list not all read yet (the vCPUs were in user mode when tried, the guest
        running): read in this pause, where a vCPU runs the kernel, which its reads see. The
        vCPUs of one tick are identified together: the others wait for the read and take it."""
        async with self._modules_lock:
            now = self.clock()
            if modules.read_whole or now - self._modules_tried < MODULES_RETRY:
                return
            self._modules_tried = now
            found = await modules.refresh()
            if found is not None:
                self.use_modules([self.kernel_modules[0], *found])

    async def _exception_link(self, transport: GuestTransport, regs: Registers) -> Registers | None:
        """``regs`` with the exception link register, read in this pause for a sample taken
        where the interrupted pc is only there (``ExceptionEntry.holds_link``), and the user stack
        pointer with it where the interrupted code is the user's and nothing of it is saved yet
        (``ExceptionEntry.holds_user``); None otherwise."""
        entry = self.entry
        if entry is None or regs.user:
            return None
        # The kernel image's slide (kernel_modules[0]; arm64 loads modules below the image:
        # the space's first module may be one of them).
        link = regs.pc - self.kernel_modules[0].bias
        if entry.holds_link(link):
            names: tuple[str, ...] = (entry.link_name,)
        elif entry.holds_user(link) and entry.user_sp is not None:
            names = (entry.link_name, entry.user_sp_name)
        else:
            return None
        # Read with the registers already (QMP's ``info registers`` text: riscv64's sepc), else
        # asked for.
        values = {name: regs.special[name] for name in names if name in regs.special}
        if len(values) < len(names):
            values = await transport.system_registers(regs.cpu, names)
        if any(name not in values for name in names):
            return None
        gprs = {**regs.gprs, entry.link: values[entry.link_name]}
        if entry.user_sp is not None and entry.user_sp_name in values:
            gprs[entry.user_sp] = values[entry.user_sp_name]
        return dataclasses.replace(regs, gprs=gprs)

    async def _identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        current, layout = self.current, self.layout
        if current is None or layout is None:
            return self.kernel
        linear = self.linear
        viewed = regs.user and self.hidden and linear is not None
        # What the sample fetched with its window (the task's stamp, what the last walk from
        # this stack read through page tables) is not read again.
        read = held(reader(transport, regs.cpu), cache)
        if viewed and linear is not None:
            read, cache = linear_reader(transport, linear, regs.cpu), PageCache()
        task = await current.pointer(read, regs, cache)
        if task is None and not viewed and linear is not None:
            # The kernel unmapped in user mode (arm64's KPTI; in kernel mode too for the few
            # instructions of an exception's entry): through the linear map.
            view, fresh = linear_reader(transport, linear, regs.cpu), PageCache()
            task = await current.pointer(view, regs, fresh)
            if task is not None:
                self.hidden = self.hidden or regs.user
                read, cache = view, fresh
        if task is None:
            return self.kernel
        stamp = self._stamp(task, cache)
        if stamp is None and not regs.user and self.tasks.known(task):
            # In kernel mode, not the task expected (the owner of the stack page: another task
            # behind the pointer now, or the sample on an interrupt stack): its stamp read now,
            # so that a task_struct reused, or a task exec'd, since it was read is not named as
            # it was where no walk reaches its user code to tell (test_riscv64_linux_e2e's
            # moments 0.1 s apart: head's task_struct holding an xz thread, named head). In
            # user mode the space must hold the pc (below).
            raw = await read_one(read, *layout.stamp_range(task))
            stamp = None if raw is None else layout.stamp_of(raw)
        seen = self.tasks.fresh(task, stamp)
        # Trusted by its age alone, a task whose space lacks the user pc has exec'd since; one
        # whose user space was gone (exiting) may be gone too, its task_struct another's now:
        # either is read again, in this pause (a stack is told whole for its user space gone
        # only on what this pause read).
        if seen and stamp is None:
            space = seen.identity.space
            if space.user_gone or (regs.user and space.find(regs.pc) is None):
                seen = None
        self._last[regs.cpu] = task
        memory = None
        if seen is None:
            found = await read_task(read, task, layout, self.arch.shared_from)
            if found is None and regs.user and not viewed and linear is not None:
                # The task held in the registers of a vCPU that reads no kernel data (riscv64:
                # user mode reads no supervisor page, M-mode firmware translates nothing):
                # through the linear map, as every user-mode sample from now on.
                view = linear_reader(transport, linear, regs.cpu)
                found = await read_task(view, task, layout, self.arch.shared_from)
                if found is not None:
                    self.hidden, read, cache = True, view, PageCache()
            identity = self.kernel
            if found is not None:
                space, memory = await self._placed(read, found, regs)
                identity = Identity(found.process, space)
            seen = self.tasks.put(task, found, identity)
        elif seen.task is not None and seen.identity is not self.kernel:
            # The process's space as its mappings stand (they are placed again when they
            # change), not as they stood when the task was read.
            space, memory = await self._placed(read, seen.task, regs)
            if space is not seen.identity.space:
                seen = self.tasks.update(task, Identity(seen.task.process, space))
        stack, size = seen.stack, self.thread_size
        on_own_stack = regs.user or (
            stack != 0 and size is not None and stack <= regs.sp < stack + size
        )
        if seen.identity is not self.kernel and on_own_stack:
            current.own(regs, task)
        elif size is not None and not on_own_stack:
            owner = await self._stack_owner(read, regs, task, size)
            if owner is not None:
                return owner
        if seen.identity.space.user_gone and not on_own_stack:
            # Not on the exiting task's own stack (an interrupt's, or the next task's in the
            # middle of a context switch): the walk may not be its, so its end is not told.
            return Identity(seen.identity.process, self.space)
        identity = seen.identity
        if memory is not None:
            identity = dataclasses.replace(identity, memory=self._through(read, memory))
        if seen.task is None or identity is self.kernel or self.spaces is None:
            return identity
        waiting = self.spaces.waiting(seen.task) and self.control is not None
        return dataclasses.replace(
            identity,
            reread_mappings=functools.partial(
                self._reread_mappings, read, task, seen.task, regs, identity
            ),
            complete=functools.partial(self._complete, seen.task, identity) if waiting else None,
        )

    async def _complete(self, task: Task, identity: Identity) -> Identity | None:
        """After cont: ``identity`` in its process's space placed again with the files it
        waited for read (a program started since the run began); None: nothing better."""
        assert self.spaces is not None and self.control is not None
        space = await self.spaces.complete(self.kernel_memory(), task)
        if space is None:
            return None
        return dataclasses.replace(identity, space=space, reread_mappings=None, complete=None)

    async def _reread_mappings(
        self,
        read: Reader,
        at: int,
        task: Task,
        regs: Registers,
        identity: Identity,
        pcs: Sequence[int],
    ) -> Identity | None:
        """``identity`` with its process's space read again, in the pause, when user addresses
        of the walk (``pcs``) fall in none of its mappings on a page not found lacking when
        they were read: a library mapped since (a kernel-mode sample asks nothing else of
        them). None: the space as it is answers for them."""
        assert self.spaces is not None and self.layout is not None
        if self.spaces.holds(task, pcs):
            return None
        # The task as read before was trusted by its age: read again before its mappings, its
        # task_struct may be another process's since (the slab's reuse; that one's mm at the
        # old one's address then gave a busybox shell's mappings to an xz that had exited).
        fresh = await read_task(read, at, self.layout, self.arch.shared_from)
        if fresh is None:
            return None
        if fresh.stamp != task.stamp:
            task, identity = fresh, dataclasses.replace(identity, process=fresh.process)
        space, memory = await self._placed(read, task, regs, pcs)
        if space is identity.space and task is not fresh:
            return None
        self.tasks.put(at, task, Identity(task.process, space))
        through = identity.memory if memory is None else self._through(read, memory)
        return dataclasses.replace(identity, space=space, memory=through, reread_mappings=None)

    async def _stack_owner(
        self, read: Reader, regs: Registers, current: int, size: int
    ) -> Identity | None:
        """The identity of the task whose kernel stack the vCPU is on when that is not the
        current task's: past the switch of stacks in a context switch (``current`` changes a
        little later), the walk is the next task's, on the page tables the vCPU holds. Only a
        task read before can be told (read again here, to be sure it still owns that stack);
        an interrupt's own stack belongs to no task (None)."""
        assert self.layout is not None
        other = self.tasks.on_stack(regs.sp, size)
        if other is None or other == current:
            return None
        found = await read_task(read, other, self.layout, self.arch.shared_from)
        if found is None or not found.stack <= regs.sp < found.stack + size:
            return None
        return Identity(found.process, await self._space(read, found, regs))

    async def _placed(
        self, read: Reader, task: Task, regs: Registers, pcs: Sequence[int] = ()
    ) -> tuple[AddressSpace, Reader | None]:
        """``task``'s space, and reads of its user memory through its own page tables when the
        vCPU holds another's (``_foreign``): asked before the space is placed, so that placing
        reads its code through them too, and again after when placing read its tables' root."""
        spaces = self.spaces
        root = None if spaces is None else spaces.pgd_of(task)
        memory = self._foreign(read, task, regs)
        space = await self._space(self._through(read, memory), task, regs, pcs)
        if memory is None and spaces is not None and spaces.pgd_of(task) != root:
            memory = self._foreign(read, task, regs)
        return space, memory

    def _foreign(self, read: Reader, task: Task, regs: Registers) -> Reader | None:
        """Reads of ``task``'s user memory through its own page tables when the vCPU has
        another's loaded: a context switch caught between loading the next process's tables and
        switching stacks (the task is still ``current``; through the vCPU its user stack reads
        as the next process's memory, or not at all). None: its own are loaded, or not known.
        Where the sampled registers hold no page-table root (``regs.space`` 0: arm64, whose
        vCPU in kernel mode reads no user memory, PAN), every kernel-mode sample of the task
        reads through them: on an interrupt's stack too, whose walk goes on into the task's
        (a stack another task owns is told apart before, ``_stack_owner``)."""
        spaces = self.spaces
        tables = None if spaces is None else spaces.tables
        if spaces is None or tables is None:
            return None
        size = self.thread_size
        rootless = regs.space == 0
        off_stack = size is None or not task.stack <= regs.sp < task.stack + size
        if not regs.user and off_stack and not rootless:
            # Past the switch of stacks (still before ``current`` changes) the walk is the
            # next task's, on the tables the vCPU holds.
            return None
        pgd = spaces.pgd_of(task)
        if pgd is None or (regs.user and rootless):
            return None
        if not rootless and holds(regs.space, pgd, tables.direct_map):
            return None
        if regs.user:
            # User code runs on its own tables: the root read is not the process's now (its
            # mm's address reused by a later exec) or the register holds more than the table's
            # address (a memory-encryption bit, say). Not trusted until read again.
            spaces.forget_pgd(task)
            return None
        kept = None
        if rootless:  # every kernel-mode sample walks: the tables kept a while
            now = self.clock()
            if now - self._tables_read > TABLES_KEPT:
                self._tables.clear()
                self._tables_read = now
            kept = self._tables
        return PageTables(
            read, tables.direct_map, tables.levels, tables.entries, tables.user_end, kept
        ).reader(pgd)

    def _through(self, read: Reader, memory: Reader | None) -> Reader:
        return read if memory is None else split(read, memory, self.arch.shared_from)

    async def _space(
        self, read: Reader, task: Task, regs: Registers, pcs: Sequence[int] = ()
    ) -> AddressSpace:
        """``task``'s space, answering for its user-mode pc and the user addresses ``pcs``."""
        if self.spaces is None:
            return self.space
        return await self.spaces.space_of(read, task, [regs.pc, *pcs] if regs.user else pcs)

    def _stamp(self, task: int, cache: PageCache) -> Stamp | None:
        """The stamp of ``task`` when the sample read it with the window (it was expected)."""
        assert self.layout is not None
        addr, size = self.layout.stamp_range(task)
        if not cache.has(addr, size):
            return None
        raw = cache.read(addr, size)
        return None if raw is None else self.layout.stamp_of(raw)
