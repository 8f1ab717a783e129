"""Where the running Linux kernel was loaded (its KASLR slide), found from the IDT the CPU
holds (``qmpprof.linux.kaslr`` votes): the IDT register from the control channel's registers,
its gates from kernel memory, both while the guest runs."""

from __future__ import annotations

from qmpprof.arch.base import InstructionSet
from qmpprof.errors import KernelMismatchError
from qmpprof.linux.kaslr import ALIGN, GATE, decode_idt, slide_from_gates
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.memory import reader
from qmpprof.transport.base import GuestTransport


async def find_slide(
    control: GuestTransport,
    symbols: KernelSymbols,
    arch: InstructionSet,
    cpu: int = 0,
    align: int = ALIGN,
) -> int:
    """The running kernel's KASLR slide (0 under ``nokaslr``) against the image's ``symbols``:
    runtime address = image address + slide, for every symbol of the image."""
    regs = await control.registers(cpu)
    base, limit = regs.special.get("idt_base"), regs.special.get("idt_limit")
    if base is None or limit is None:
        raise KernelMismatchError("the vCPU's registers show no IDT: no KASLR slide")
    if base < arch.shared_from:
        raise KernelMismatchError(f"IDT at {base:#x} is not in kernel space (kernel not booted?)")
    (data,) = await reader(control, cpu)([(base, min(limit + 1, 256 * GATE.size))])
    if data is None:
        raise KernelMismatchError(f"the IDT at {base:#x} does not read")
    return slide_from_gates(decode_idt(data), symbols, arch.shared_from, align)
