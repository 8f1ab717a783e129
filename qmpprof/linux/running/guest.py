"""A Linux guest's life in a run: what its kernel's BTF says of its structures (``Layouts``,
read when the kernel is loaded, before the guest is touched); then, attached to the running
guest, the kernel image at its slide, its modules, every vCPU's per-CPU base, every task and
each process's code placed through its own page tables, all read before the first stop through
the control channel while the guest runs, and handed to ``identify.LinuxIdentifier``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.image import ElfImage
from qmpprof.errors import NoKernelRunningError, UsageError
from qmpprof.guest.base import Attached, FoundTask, Identity
from qmpprof.guest.userfiles import UserFiles
from qmpprof.linux.btf import Btf, BtfError
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.current import CurrentTask, PerCpuVariable, locate_current
from qmpprof.linux.running.identify import LinuxIdentifier
from qmpprof.linux.running.image import kernel_module
from qmpprof.linux.running.kernelmemory import KernelTables, beyond_user_mode, kernel_root
from qmpprof.linux.running.linearmap import LinearMap, find_linear_map
from qmpprof.linux.running.moduledebug import DebugLayout, debuginfod_asked
from qmpprof.linux.running.modules import ModuleLayout, ModuleList
from qmpprof.linux.running.offcpu import OffCpuLayout, TaskListReader, read_states
from qmpprof.linux.running.platform import LinuxPlatform, LoadedKernel
from qmpprof.linux.running.platforms import linux_platform
from qmpprof.linux.running.spaces import Spaces
from qmpprof.linux.running.tasks import RECHECK, TaskLayout, task_list
from qmpprof.linux.running.vma import VmaLayout
from qmpprof.linux.running.vmcoreinfo import check, read_vmcoreinfo
from qmpprof.memory import Reader, kernel_reader
from qmpprof.model import Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import AddressSpace

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Layouts:
    """What the kernel's BTF says of its structures (None: this kernel lacks it; ``notes`` say
    what is missing then, one line each)."""

    tasks: TaskLayout | None
    current: PerCpuVariable | None  # the current task pointer
    modules: ModuleLayout | None
    vmas: VmaLayout | None
    notes: tuple[str, ...]
    # What a task off CPU leaves behind, or why it cannot be read (told with --off-cpu only).
    offcpu: OffCpuLayout | str = "no BTF"

    @classmethod
    def of(cls, kernel: LinuxKernel) -> Layouts:
        notes = list(kernel.missing)
        btf = kernel.btf
        if btf is None:
            return cls(None, None, None, None, tuple(notes))
        names = "stacks without process names"
        tasks = _from_btf(btf, TaskLayout.from_btf, names, notes)
        arch = kernel.image.arch
        platform = linux_platform(arch.name)
        located = None
        if platform is None or platform.current_task(arch, time.monotonic, RECHECK) is None:
            located = _from_btf(btf, lambda _: locate_current(kernel), names, notes)
        current = None if located is None else located[0]
        if located is not None and located[1] is not None:
            notes.append(located[1])
        if kernel.thread_size is None:
            notes.append("no init_stack's end in kallsyms: a task's stack size is not known")
        modules = _from_btf(btf, ModuleLayout.from_btf, "module frames unnamed", notes)
        vmas = _from_btf(btf, VmaLayout.from_btf, "user code is not placed", notes)
        offcpu: OffCpuLayout | str = f"Linux on {arch.name}: no switch frame known"
        try:
            if platform is not None:
                offcpu = OffCpuLayout.from_btf(btf, arch, platform)
        except (KeyError, BtfError) as err:
            offcpu = f"its BTF lacks {err}"
        return cls(tasks, current, modules, vmas, tuple(notes), offcpu)


async def _system_registers(
    transport: GuestTransport,
    arch: InstructionSet,
    per_cpu: tuple[str, ...],
    cpus: Sequence[int],
) -> tuple[dict[str, int], dict[int, int]]:
    """The first vCPU's translation registers, and each vCPU's per-CPU base from the system
    register that holds it (``per_cpu``, the platform's ``per_cpu_registers``: arm64's
    TPIDR_EL1, exact in every mode, where 6.1's kallsyms place no ``__per_cpu_offset``), one stop
    a vCPU; empty where unreadable."""
    translation = arch.translation_registers
    values: dict[str, int] = {}
    bases: dict[int, int] = {}
    for cpu in cpus:
        wanted = (*per_cpu, *translation) if cpu == cpus[0] else per_cpu
        if not wanted:
            break
        found = await transport.system_registers(cpu, wanted)
        if cpu == cpus[0]:
            values = {name: found[name] for name in translation if name in found}
        if per_cpu and found.get(per_cpu[0]):
            bases[cpu] = found[per_cpu[0]]
    return values, bases


def _slots(current: CurrentTask) -> list[int]:
    """The current-task slots of the vCPUs whose per-CPU base is known (linear addresses)."""
    return [(base + current.offset) & current.arch.mask for base in current.bases.values()]


def _platform(arch: InstructionSet) -> LinuxPlatform:
    platform = linux_platform(arch.name)
    if platform is None:
        raise UsageError(f"Linux on {arch.name} is not read: no platform for it")
    return platform


def _from_btf(btf: Btf, make: Callable[[Btf], _T], lacking: str, notes: list[str]) -> _T | None:
    try:
        return make(btf)
    except KeyError as err:
        notes.append(f"this kernel's BTF lacks {err}: {lacking}")
        return None
    except BtfError as err:
        notes.append(f"unreadable BTF ({err}): {lacking}")
        return None


class LinuxGuest:
    """The ``Guest`` of a Linux kernel: loaded (``kernel``, ``layouts``, the files of
    ``--user-dir``), then attached to the running guest (``identifier``)."""

    def __init__(
        self,
        kernel: LinuxKernel,
        arch: InstructionSet,
        files: UserFiles,
        *,
        lines: bool = False,
        debug: ElfImage | None = None,
        notes: tuple[str, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kernel = kernel
        self.arch = arch
        self.files = files
        self.lines = lines
        self.debug = debug  # the kernel's debug file (debuginfod's), for its lines
        self.load_notes = notes  # what loading could not bring
        self.clock = clock
        self.layouts = Layouts.of(kernel)
        self.platform = _platform(arch)
        self.identifier = LinuxIdentifier([], arch, clock=clock)  # until attached
        self.task_reader: TaskListReader | str = "not attached"  # every task, or why not
        self.kernel_tables: KernelTables | None = None  # arm64: for vmalloc'd stacks at EL0

    async def attach(self, transport: GuestTransport) -> Attached:
        """The slide, the modules, every vCPU's per-CPU base, every task and each process's
        code placed, read through the control channel while the guest runs."""
        control = transport.control
        if control is None:
            raise UsageError(
                "a Linux guest is read over QMP between samples (its KASLR slide, its tasks):"
                " give the VM's --qmp-socket beside --gdb"
            )
        kernel, layouts = self.kernel, self.layouts
        translation: list[str] = []
        cpus = await control.cpus()
        # Read once per attach (the sampler's walker takes the instruction set from here).
        per_cpu = self.platform.per_cpu_registers
        values, bases = await _system_registers(transport, self.arch, per_cpu, cpus)
        if self.arch.translation_registers:
            self.arch = self.arch.translated(values)
            if not values:
                translation.append(
                    f"{', '.join(self.arch.translation_registers)} not readable over this"
                    " transport: return addresses signed by pointer authentication end kernel"
                    " stacks (use the gdbstub)"
                )
        offsets = kernel.per_cpu_offsets
        unplaced = len(bases) < len(cpus) and offsets is None
        if layouts.current is not None and unplaced and per_cpu:
            translation.append(
                f"no __per_cpu_offset found and {per_cpu[0]} not readable"
                " over this transport: stacks without process names (use the gdbstub)"
            )
        arch, platform = self.arch, self.platform
        try:
            slide = await platform.slide(control, kernel, arch, transport)
        except NoKernelRunningError:
            if kernel.kallsyms_slide is None:
                raise
            slide = kernel.kallsyms_slide  # the user's word, where the guest can say nothing
            translation.append(
                f"KASLR slide {slide:#x} as --kallsyms says: no vCPU ran the kernel to check it"
            )
        read = kernel_reader(control, cpus)
        own = await read_vmcoreinfo(read, kernel, slide)
        checks = None if own is None else check(own, kernel, slide)
        entry = platform.entry_code(kernel)
        if isinstance(entry, str):  # the walk then stops at an exception's entry
            translation.append(entry)
            entry = None
        modules = [
            kernel_module(kernel, slide, arch, platform, entry, lines=self.lines, debug=self.debug)
        ]
        in_registers = platform.current_task(arch, self.clock, RECHECK)
        current = in_registers
        if in_registers is None and layouts.current is not None:
            per_cpu_offset = None if offsets is None else offsets + slide
            place = layouts.current.at(slide)
            current = CurrentTask(
                place, per_cpu_offset, arch, self.clock, RECHECK, platform.per_cpu_base
            )
            current.bases.update(bases)
            await current.preload(read, cpus)
        linear = None
        loaded = LoadedKernel(read, kernel, slide, arch, control, values)
        low, high = kernel.image.load_range  # the whole image, its data too
        mapped = kernel.address("_stext", slide) or low + slide
        image = (low + slide, high + slide, mapped)
        linear_end = platform.linear_map_end(arch)
        top = image[0] if linear_end is None else min(image[0], linear_end)
        # The linear map is measured at the per-CPU slots of the current task's pointer.
        slotted = None if in_registers is not None else current
        if slotted is not None:
            walk = platform.kernel_walk(loaded)
            linear = await find_linear_map(
                control, _slots(slotted), arch.shared_from, top, image, walk=walk
            )
        else:
            linear = await platform.linear_map(loaded)
        tables = await platform.page_tables(loaded, linear)
        end = arch.user_space_end
        spaces = Spaces(
            AddressSpace(()), layouts.vmas, self.files, tables, self.clock, end, arch=arch
        )

        async def measured() -> LinearMap | None:
            """The linear map measured between samples (no vCPU was in the kernel at attach),
            and the page tables walked in it, where they are."""
            if slotted is not None:
                found = await find_linear_map(
                    control, _slots(slotted), arch.shared_from, top, image, tries=1
                )
            else:  # the kernel's variable
                found = await platform.linear_map(loaded)
            if found is not None and spaces.tables is None:
                spaces.tables = await platform.page_tables(loaded, found)
            return found

        # What no vCPU at EL0 translates (modules, vmalloc'd stacks) through the kernel's tables.
        self.kernel_tables = None
        if linear is not None and spaces.tables is not None and layouts.vmas is not None:
            seen = beyond_user_mode(control, cpus, linear)
            root = await kernel_root(seen, kernel, slide, layouts.vmas.pgd)
            if root is None:  # no init_mm named: the tables the registers lead to
                physical = await platform.kernel_root(loaded)
                root = None if physical is None else linear.offset + physical
            self.kernel_tables = None if root is None else KernelTables(spaces.tables, root)
        head = kernel.module_list
        module_list = None
        if layouts.modules is not None and head is not None:
            debug = self._module_debug(translation)
            steps = functools.partial(platform.module_steps, kernel, arch)
            beyond = beyond_user_mode(control, cpus, linear, self.kernel_tables)
            module_list = ModuleList(beyond, head + slide, layouts.modules, steps, arch, debug)
            modules += await module_list.refresh() or []
        self.identifier = LinuxIdentifier(
            modules,
            arch,
            layout=layouts.tasks,
            current=current,
            spaces=spaces,
            module_list=module_list,
            control=control,
            thread_size=kernel.thread_size,
            linear=linear,
            find_linear=measured if linear is None else None,
            cpus=cpus,
            clock=self.clock,
            entry=entry,
            kernel_tables=self.kernel_tables,
        )
        init_task = kernel.address("init_task", slide)
        beyond = self.identifier.kernel_memory()
        if layouts.tasks is not None and init_task is not None:
            await self.identifier.preload(beyond, await task_list(beyond, init_task, layouts.tasks))
        # The states' names are read where a vCPU in user mode cannot see them too.
        self.task_reader = await self._task_reader(beyond, slide, current, spaces)
        names = ", ".join(m.name for m in modules[1:]) or "none"
        detail = [
            f"Linux kernel {kernel.path}: KASLR slide {slide:#x}, {len(modules) - 1} modules"
            f" ({names})",
        ]
        notes = list(layouts.notes) + translation + list(self.load_notes)
        notes += [] if module_list is None else module_list.notes  # what a ceiling cut
        if own is None or checks is None:
            notes.append("no vmcoreinfo in the guest: the slide and symbols are not checked")
        else:
            release = own.get("OSRELEASE", "?")
            detail.append(f"vmcoreinfo: Linux {release}, {checks.confirmed} symbols confirmed")
            notes += checks.notes
        return Attached(tuple(detail), tuple(f"{kernel.path}: {note}" for note in notes))

    def _module_debug(self, notes: list[str]) -> DebugLayout | None:
        """Where modules' build-ids and sections are, where lines are wanted and a debuginfod
        server may give their debug files."""
        btf = self.kernel.btf
        if not self.lines or btf is None or not debuginfod_asked():
            return None
        return _from_btf(btf, DebugLayout.from_btf, "module frames without source lines", notes)

    async def _task_reader(
        self, read: Reader, slide: int, current: CurrentTask | None, spaces: Spaces
    ) -> TaskListReader | str:
        """What reading every task takes, or why this kernel does not allow it."""
        layouts, kernel = self.layouts, self.kernel
        if isinstance(layouts.offcpu, str):
            return layouts.offcpu
        init_task, array, size = kernel.off_cpu_addresses()
        if layouts.tasks is None or init_task is None:
            return "no task layout or init_task"
        states = None if array is None else await read_states(read, array + slide, self.arch)
        if states is None:
            return "no task_state_array in its symbols, or not as /proc shows it"
        return TaskListReader(
            init_task + slide,
            layouts.tasks,
            layouts.offcpu,
            states,
            self.arch,
            size,
            current,
            spaces,
        )

    async def every_task(self, transport: GuestTransport) -> Sequence[FoundTask]:
        if isinstance(self.task_reader, str):
            raise UsageError(f"{self.kernel.path}: cannot read every task: {self.task_reader}")
        return await self.task_reader.every_task(await self._kernel_memory(transport))

    async def versions(
        self, transport: GuestTransport, tasks: Sequence[FoundTask]
    ) -> list[tuple[int, ...] | None]:
        if isinstance(self.task_reader, str):
            raise UsageError(f"{self.kernel.path}: cannot read every task: {self.task_reader}")
        read = await self._kernel_memory(transport)
        return await self.task_reader.versions(read, [t.at for t in tasks])

    async def _kernel_memory(self, transport: GuestTransport) -> Reader:
        """Kernel memory through ``transport``'s vCPUs in turn, then what none of them mapped
        (each in user mode: arm64's KPTI) physically through the linear map where it is known
        (slower: the monitor's ``xp`` over QMP), and the rest (vmalloc'd stacks) through the
        kernel's own page tables."""
        return self.identifier.kernel_memory(transport, await transport.cpus())

    async def housekeep(self) -> None:
        await self.identifier.housekeep()

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        return self.identifier.reads_for(regs)

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        return await self.identifier.identify(transport, regs, cache)
