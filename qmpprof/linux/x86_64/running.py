"""x86_64's running Linux (``running.platform.LinuxPlatform``): the slide from the IDT the CPU
holds (``idt`` votes), the page tables from the direct map's base and ``__pgtable_l5_enabled``,
a task off CPU's ``inactive_task_frame`` (``taskframe``); its exception entry needs no
description, its ORC tables cover it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.arch.x86 import X86_64 as X86_64_ISA
from qmpprof.errors import KernelMismatchError
from qmpprof.linux.btf import Btf
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.current import CurrentTask
from qmpprof.linux.running.linearmap import LinearMap
from qmpprof.linux.running.modules import ModuleLayout
from qmpprof.linux.running.pagetables import PageTables, page_tables
from qmpprof.linux.running.platform import LoadedKernel
from qmpprof.linux.running.slide import slide_by_banner
from qmpprof.linux.running.switch import SwitchLayout
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.linux.x86_64.idt import ALIGN, GATE, decode_idt, slide_from_gates
from qmpprof.linux.x86_64.moduleorc import module_orc
from qmpprof.linux.x86_64.orcstep import OrcCode, OrcStep
from qmpprof.linux.x86_64.orctables import INDIRECT_THUNKS, OrcTable, unaliased
from qmpprof.linux.x86_64.taskframe import InactiveTaskFrame
from qmpprof.memory import Reader, reader
from qmpprof.model import Registers
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.steps import ExceptionEntry, UnwindStep
from qmpprof.unwind.tailcall import TargetKind


async def idt_slide(
    control: GuestTransport,
    symbols: KernelSymbols,
    arch: InstructionSet,
    cpu: int = 0,
    align: int = ALIGN,
    *,
    kernel: LinuxKernel | None = None,
) -> int:
    """The running kernel's KASLR slide (0 under ``nokaslr``) against the image's ``symbols``:
    runtime address = image address + slide, for every symbol of the image. Without an IDT in
    the vCPU's registers (not every transport shows it), by the banner of ``kernel``'s image."""
    regs = await control.registers(cpu)
    base, limit = regs.special.get("idt_base"), regs.special.get("idt_limit")
    if (base is None or limit is None) and kernel is not None:
        return await slide_by_banner(control, kernel, arch)
    if base is None or limit is None:
        raise KernelMismatchError("the vCPU's registers show no IDT: no KASLR slide")
    if base < arch.shared_from:
        raise KernelMismatchError(f"IDT at {base:#x} is not in kernel space (kernel not booted?)")
    (data,) = await reader(control, cpu)([(base, min(limit + 1, 256 * GATE.size))])
    if data is None:
        raise KernelMismatchError(f"the IDT at {base:#x} does not read")
    return slide_from_gates(decode_idt(data), symbols, arch.shared_from, align)


@dataclass(frozen=True, slots=True)
class X86_64Platform:
    name: str = "x86_64"

    async def slide(
        self,
        control: GuestTransport,
        kernel: LinuxKernel,
        arch: InstructionSet,
        transport: GuestTransport,
    ) -> int:
        return await idt_slide(control, kernel.symbols, arch, kernel=kernel)

    async def page_tables(
        self, loaded: LoadedKernel, linear: LinearMap | None
    ) -> PageTables | None:
        return await page_tables(
            loaded.read,
            loaded.address("page_offset_base"),
            loaded.address("__pgtable_l5_enabled"),
        )

    def switch_layout(self, btf: Btf, arch: InstructionSet) -> SwitchLayout:
        return InactiveTaskFrame.from_btf(btf, arch)

    def entry_code(self, kernel: LinuxKernel) -> ExceptionEntry | str | None:
        return None

    def current_task(
        self, arch: InstructionSet, clock: Callable[[], float], recheck: float
    ) -> CurrentTask | None:
        return None

    async def linear_map(self, loaded: LoadedKernel) -> LinearMap | None:
        return None

    def kernel_walk(self, loaded: LoadedKernel) -> Callable[[int], Awaitable[int | None]] | None:
        return None

    async def kernel_root(self, loaded: LoadedKernel) -> int | None:
        return None

    @property
    def per_cpu_registers(self) -> tuple[str, ...]:
        return ()  # GS in kernel mode; KERNEL_GS_BASE (not read) in user mode

    def per_cpu_base(self, regs: Registers) -> int | None:
        # In kernel mode (after swapgs) GS holds the per-CPU base; in user mode the user's.
        base = regs.special.get("gs_base", 0)
        return base if not regs.user and base >= X86_64_ISA.shared_from else None

    def linear_map_end(self, arch: InstructionSet) -> int | None:
        return None  # the direct map lies below the vmalloc area and the image: not needed

    def kernel_steps(
        self, kernel: LinuxKernel, slide: int, arch: InstructionSet
    ) -> Sequence[UnwindStep]:
        if not isinstance(kernel.tables, OrcTable):
            return ()
        return (OrcStep(OrcCode(kernel.tables, kernel.functions, kernel.thunks), slide, arch),)

    async def module_steps(
        self,
        kernel: LinuxKernel,
        arch: InstructionSet,
        read: Reader,
        at: int,
        layout: ModuleLayout,
        bias: int,
    ) -> Sequence[UnwindStep]:
        # A module's tables are written as its kernel's are.
        kernel_orc = kernel.tables if isinstance(kernel.tables, OrcTable) else None
        table = await module_orc(read, at, layout, kernel_orc)
        return () if table is None else (OrcStep(OrcCode(table), bias, arch),)

    def target_kind(self, name: str) -> TargetKind:
        return target_kind(name)


def target_kind(name: str) -> TargetKind:
    """What a jump or call to the kernel symbol ``name`` means for the tail-call search. The
    names are the same from 5.10 to 7.3 once a 6.16+ startup-code alias's ``__pi_`` prefix is
    left out (``orctables.unaliased``): ``__x86_indirect_*`` (``orctables.INDIRECT_THUNKS``:
    the target is in a register), ``__x86_return_thunk``/``*untrain_ret`` (a ``ret``),
    ``__SCT__*`` (static-call trampolines: no DWARF, gdb stops there)."""
    name = unaliased(name)
    if name.startswith(INDIRECT_THUNKS):
        return TargetKind.INDIRECT
    if name.endswith(("return_thunk", "untrain_ret")):
        return TargetKind.RETURN
    if name.startswith("__SCT__"):
        return TargetKind.OPAQUE
    return TargetKind.FUNCTION


X86_64 = X86_64Platform()
