"""What Linux does its own way on each instruction set, as the running guest shows it: one
``LinuxPlatform`` per instruction set, chosen by ``platforms.linux_platform`` (the kernel
file's half is ``qmpprof.linux.platform``). The rest of the running guest's code names no
instruction set: it asks the platform."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from qmpprof.arch.base import InstructionSet
from qmpprof.linux.btf import Btf
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.current import CurrentTask
from qmpprof.linux.running.linearmap import LinearMap
from qmpprof.linux.running.modules import ModuleLayout
from qmpprof.linux.running.pagetables import PageTables
from qmpprof.linux.running.switch import SwitchLayout
from qmpprof.memory import Reader
from qmpprof.model import Registers
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.steps import ExceptionEntry, UnwindStep
from qmpprof.unwind.tailcall import TargetKind


@dataclass(frozen=True, slots=True)
class LoadedKernel:
    """The running kernel as a platform reads it once its slide is known: its memory through
    a vCPU that can read it (``read``), the kernel file and its slide, the instruction set, and
    the guest's control channel for what a platform reads its own way (``control``)."""

    read: Reader
    kernel: LinuxKernel
    slide: int
    arch: InstructionSet
    control: GuestTransport
    # The first vCPU's translation registers as the whole transport read them (arm64's
    # TCR_EL1 and TTBR1_EL1; empty over a transport without system registers).
    registers: Mapping[str, int] = field(default_factory=dict)

    def address(self, name: str) -> int | None:
        """Where the running kernel put the symbol ``name``; None: the file has no such symbol."""
        return self.kernel.address(name, self.slide)


class LinuxPlatform(Protocol):
    """One instruction set's running Linux: where it was loaded, how its page tables are found,
    what a task off CPU leaves behind, how its exceptions are entered."""

    @property
    def name(self) -> str:
        """The instruction set's name (``InstructionSet.name``)."""
        ...

    async def slide(
        self,
        control: GuestTransport,
        kernel: LinuxKernel,
        arch: InstructionSet,
        transport: GuestTransport,
    ) -> int:
        """The running kernel's KASLR slide (runtime - link address) against ``kernel``'s
        image, read while the guest runs (``control``; ``transport``: the whole transport, for
        system registers); KernelMismatchError when it cannot be told."""
        ...

    async def page_tables(
        self, loaded: LoadedKernel, linear: LinearMap | None
    ) -> PageTables | None:
        """The processes' page tables, as the kernel's variables describe them (x86_64: its
        direct map's base and paging levels) or walked in its linear map (``linear``, once
        found: arm64, riscv64), the variables read through ``loaded.read`` (kernel memory) or
        where the platform knows how through ``loaded.control``; None while they cannot be told."""
        ...

    def switch_layout(self, btf: Btf, arch: InstructionSet) -> SwitchLayout:
        """Where a task off CPU keeps its registers, as this kernel's BTF describes it;
        KeyError naming what the BTF lacks."""
        ...

    def entry_code(self, kernel: LinuxKernel) -> ExceptionEntry | str | None:
        """The kernel's exception entry code as the walk needs it described, where the image's
        unwinding tables do not cover it; None when not needed, or one line saying why it is
        not described."""
        ...

    def current_task(
        self, arch: InstructionSet, clock: Callable[[], float], recheck: float
    ) -> CurrentTask | None:
        """Where no per-CPU variable holds the current task, how the vCPU's registers say it
        (riscv64's tp); None: the per-CPU variable does (``current.locate_current``)."""
        ...

    async def linear_map(self, loaded: LoadedKernel) -> LinearMap | None:
        """The linear map as the kernel's variables describe it (read as ``page_tables``
        reads), where the current task's per-CPU slots do not measure it (``current_task``:
        no such slots); None otherwise."""
        ...

    def kernel_walk(self, loaded: LoadedKernel) -> Callable[[int], Awaitable[int | None]] | None:
        """Where a kernel address is in physical memory with no vCPU in kernel mode to
        translate it (arm64: the kernel's own tables, at TTBR1_EL1, walked physically); None
        where the platform has no such way."""
        ...

    async def kernel_root(self, loaded: LoadedKernel) -> int | None:
        """The physical address of the kernel's own page tables where no symbol names them
        (``init_mm``), as the vCPUs' registers lead to them (arm64: TTBR1_EL1); None where
        the platform has no such way."""
        ...

    @property
    def per_cpu_registers(self) -> tuple[str, ...]:
        """The system registers (as QEMU's gdbstub names them) that hold the kernel's per-CPU
        base in user mode as in kernel mode, read on every vCPU when memory does not say it;
        empty when none (``per_cpu_base`` reads it from the sampled registers)."""
        ...

    def per_cpu_base(self, regs: Registers) -> int | None:
        """The kernel's per-CPU base as the vCPU holds it in kernel mode, None when not known."""
        ...

    def linear_map_end(self, arch: InstructionSet) -> int | None:
        """Where the kernel's map of all physical memory ends under the translation settings
        ``arch`` was read with (arm64: its modules and vmalloc area lie above, up to the kernel
        image); None where only the kernel image's start bounds it."""
        ...

    def kernel_steps(
        self, kernel: LinuxKernel, slide: int, arch: InstructionSet
    ) -> Sequence[UnwindStep]:
        """The walk's steps through the kernel image's own tables (``kernel.tables``: x86_64's
        ORC), at ``slide``; none where it has none (then CFI, prologues and frame records)."""
        ...

    async def module_steps(
        self,
        kernel: LinuxKernel,
        arch: InstructionSet,
        read: Reader,
        at: int,
        layout: ModuleLayout,
        bias: int,
    ) -> Sequence[UnwindStep]:
        """The walk's steps through the own tables of the module whose ``struct module`` is at
        ``at`` (read through ``read``: x86_64's ORC), for its code at ``bias``; none where it
        has none or they do not read."""
        ...

    def target_kind(self, name: str) -> TargetKind:
        """What a jump or call to the kernel symbol ``name`` means for the tail-call search (the
        kernel's thunks and trampolines, by their names)."""
        ...


class NoOwnTables:
    """The part of a ``LinuxPlatform`` whose kernel brings no unwinding tables of its own
    (arm64, riscv64: the walk takes CFI, prologues and frame records) and no thunks the
    tail-call search must know."""

    __slots__ = ()

    def kernel_steps(
        self, kernel: LinuxKernel, slide: int, arch: InstructionSet
    ) -> Sequence[UnwindStep]:
        return ()

    async def module_steps(
        self,
        kernel: LinuxKernel,
        arch: InstructionSet,
        read: Reader,
        at: int,
        layout: ModuleLayout,
        bias: int,
    ) -> Sequence[UnwindStep]:
        return ()

    def target_kind(self, name: str) -> TargetKind:
        return TargetKind.FUNCTION
