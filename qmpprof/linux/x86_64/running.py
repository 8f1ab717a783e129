"""x86_64's running Linux (``running.platform.LinuxPlatform``): the slide from the IDT the CPU
holds (``idt`` votes), the page tables from the direct map's base and ``__pgtable_l5_enabled``,
a task off CPU's ``inactive_task_frame`` (``taskframe``); its exception entry needs no
description, its ORC tables cover it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.errors import KernelMismatchError
from qmpprof.linux.btf import Btf
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.current import CurrentTask
from qmpprof.linux.running.linearmap import LinearMap
from qmpprof.linux.running.pagetables import PageTables, page_tables
from qmpprof.linux.running.platform import LoadedKernel
from qmpprof.linux.running.slide import slide_by_banner
from qmpprof.linux.running.switch import SwitchLayout
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.linux.x86_64.idt import ALIGN, GATE, decode_idt, slide_from_gates
from qmpprof.linux.x86_64.taskframe import InactiveTaskFrame
from qmpprof.memory import reader
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.steps import ExceptionEntry


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


X86_64 = X86_64Platform()
