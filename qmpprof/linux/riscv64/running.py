"""riscv64's running Linux (``running.platform.LinuxPlatform``): where the kernel was loaded
(none of its own choosing unless its ELF says it is relocatable), the processes' page tables
(Sv39, Sv48 or Sv57, as the kernel set satp's mode) walked through its linear map, and the
current task in the vCPU's registers (``RegisterTask``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.arch.riscv64 import va_bits
from qmpprof.linux.btf import Btf
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.current import CurrentTask
from qmpprof.linux.running.linearmap import LinearMap
from qmpprof.linux.running.pagetables import EntryFormat, PageTables
from qmpprof.linux.running.slide import slide_by_banner
from qmpprof.linux.running.switch import SwitchLayout
from qmpprof.memory import Reader, read_ints
from qmpprof.model import Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.entry import EntryCode

_ET_EXEC = 2  # e_type of an ELF linked at fixed addresses (a relocatable kernel is ET_DYN)
# A page-table entry (privileged ISA, Sv39/48/57): V at bit 0, R/W/X at bits 1..3 (any of them
# set: a leaf, which maps a page of its level's size), the PPN at bits 10..53: the physical
# address is the PPN shifted left by 12, the masked entry by 2.
RISCV64_ENTRIES = EntryFormat(((1 << 44) - 1) << 10, 0b1110, True, shift=2)
TP = 4  # x4: the thread pointer, ``current`` in the kernel (arch/riscv/include/asm/current.h)
SCRATCH = "sscratch"
# struct kernel_mapping's members the linear map is read from, in Riscv64Platform.linear_map's order
_MAPPING = ("page_offset", "va_pa_offset", "virt_addr", "size", "va_kernel_pa_offset")
ENTRY_NOTE = (
    "riscv64's exception entry is not described yet: a kernel stack is not followed across it"
    " into the interrupted code"
)


class RegisterTask(CurrentTask):
    """riscv64 Linux's current task, which no per-CPU variable holds: the kernel keeps it in
    tp while it runs; entered from user mode (tp the user's thread pointer then), its entry code
    swaps it in from sscratch (arch/riscv/kernel/entry.S: ``handle_exception`` begins
    ``csrrw tp, CSR_SCRATCH, tp``, and ``ret_from_exception`` writes tp to sscratch before
    ``sret`` to user mode; from kernel mode sscratch is 0 and the swap undone). So where tp
    holds no kernel address (user mode, or the entry's first instructions) sscratch says it,
    read in the pause when the registers sampled lack it (the gdbstub's ``g`` packet)."""

    def __init__(self, arch: InstructionSet, clock: Callable[[], float], recheck: float) -> None:
        super().__init__(0, None, arch, clock, recheck)
        self.per_cpu = False

    def wants(self, regs: Registers) -> tuple[str, ...]:
        if self._kernel(regs.gprs.get(TP)) is not None or SCRATCH in regs.special:
            return ()
        return (SCRATCH,)

    async def preload(self, read: Reader, cpus: Sequence[int]) -> None:
        return None  # no per-CPU base to read

    async def running(self, read: Reader) -> dict[int, int]:
        return {}  # the registers are read in a pause only

    async def pointer(self, read: Reader, regs: Registers, cache: PageCache) -> int | None:
        found = self._kernel(regs.gprs.get(TP))
        return self._kernel(regs.special.get(SCRATCH)) if found is None else found

    def _kernel(self, value: int | None) -> int | None:
        return value if value is not None and value >= self.arch.shared_from else None


@dataclass(frozen=True, slots=True)
class Riscv64Platform:
    name: str = "riscv64"

    async def slide(
        self,
        control: GuestTransport,
        kernel: LinuxKernel,
        arch: InstructionSet,
        transport: GuestTransport,
    ) -> int:
        """0 for a kernel its ELF links at fixed addresses (ET_EXEC: without
        CONFIG_RELOCATABLE, as Debian's 6.12), else where its banner reads."""
        e_type = int.from_bytes(kernel.image.file_bytes(16, 2), "little")
        return 0 if e_type == _ET_EXEC else await slide_by_banner(control, kernel, arch)

    async def kernel_page_tables(
        self, read: Reader, kernel: LinuxKernel, slide: int
    ) -> PageTables | None:
        """The levels of the mode the kernel writes in satp (``satp_mode``: satp's MODE in its
        top 4 bits), through the linear map at ``kernel_map.va_pa_offset`` above physical
        memory (``linear_mapping_pa_to_va``, arch/riscv/include/asm/page.h)."""
        mode_at, mapping = kernel.address("satp_mode", slide), kernel.address("kernel_map", slide)
        if kernel.btf is None or mode_at is None or mapping is None:
            return None
        try:
            offset = mapping + kernel.btf.offset_of("kernel_mapping.va_pa_offset")
        except KeyError:
            return None
        mode, va_pa_offset = await read_ints(read, [(mode_at, 8), (offset, 8)])
        bits = None if mode is None else va_bits(mode)
        if bits is None or va_pa_offset is None:
            return None
        levels = (bits - 12) // 9
        return PageTables(read, va_pa_offset, levels, RISCV64_ENTRIES, 1 << (bits - 1))

    def linear_page_tables(
        self, read: Reader, linear: LinearMap, arch: InstructionSet
    ) -> PageTables | None:
        return None

    def switch_layout(self, btf: Btf, arch: InstructionSet) -> SwitchLayout:
        raise KeyError("nothing: riscv64's switch frame (thread_struct) is not read yet")

    def entry_code(self, kernel: LinuxKernel) -> EntryCode | str | None:
        return ENTRY_NOTE

    def current_task(
        self, arch: InstructionSet, clock: Callable[[], float], recheck: float
    ) -> CurrentTask | None:
        return RegisterTask(arch, clock, recheck)

    async def linear_map(self, read: Reader, kernel: LinuxKernel, slide: int) -> LinearMap | None:
        """From ``kernel_map`` (arch/riscv/mm/init.c): RAM at ``page_offset``, ``va_pa_offset``
        above its physical address, up to the modules' 2 GiB below the image; the image at
        ``virt_addr``, ``va_kernel_pa_offset`` above its own. A vCPU in user mode reads no
        supervisor page, one in M-mode firmware translates nothing: such samples read the
        kernel's data physically through it."""
        mapping = kernel.address("kernel_map", slide)
        if kernel.btf is None or mapping is None:
            return None
        try:
            offsets = [kernel.btf.offset_of(f"kernel_mapping.{name}") for name in _MAPPING]
        except KeyError:
            return None
        found = await read_ints(read, [(mapping + offset, 8) for offset in offsets])
        if None in found:
            return None
        page_offset, va_pa_offset, virt_addr, size, image_offset = (v or 0 for v in found)
        image = (virt_addr, virt_addr + size, image_offset)
        return LinearMap(page_offset, virt_addr - (1 << 31), va_pa_offset, image)


RISCV64 = Riscv64Platform()
