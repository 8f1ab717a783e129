"""riscv64's running Linux (``running.platform.LinuxPlatform``): where the kernel was loaded
(none of its own choosing unless its ELF says it is relocatable), the processes' page tables
(Sv39, Sv48 or Sv57, as the kernel set satp's mode) walked through its linear map, and the
current task in the vCPU's registers (``RegisterTask``). The kernel's variables that say the
linear map are read through a vCPU's own page tables when no vCPU runs the kernel
(``read_kernel``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.arch.riscv64 import va_bits
from qmpprof.linux.btf import Btf
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.riscv64.entry import entry_code
from qmpprof.linux.riscv64.threadstruct import ThreadStruct
from qmpprof.linux.running.current import PRELOAD_TRIES, CurrentTask
from qmpprof.linux.running.linearmap import LinearMap
from qmpprof.linux.running.pagetables import EntryFormat, PageTables
from qmpprof.linux.running.platform import LoadedKernel, NoOwnTables
from qmpprof.linux.running.slide import slide_by_banner
from qmpprof.linux.running.switch import SwitchLayout
from qmpprof.memory import Reader
from qmpprof.model import Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.steps import ExceptionEntry

_PPN = (1 << 44) - 1  # satp's root page number, bits 43..0
_ET_EXEC = 2  # e_type of an ELF linked at fixed addresses (a relocatable kernel is ET_DYN)
TP = 4  # x4: the thread pointer, ``current`` in the kernel (arch/riscv/include/asm/current.h)
SCRATCH = "sscratch"
# struct kernel_mapping's members the linear map is read from, in Riscv64Platform.linear_map's order
_MAPPING = ("page_offset", "va_pa_offset", "virt_addr", "size", "va_kernel_pa_offset")
# A page-table entry (privileged ISA, Sv39/48/57): V at bit 0, R/W/X at bits 1..3 (any of them
# set: a leaf, which maps a page of its level's size), the PPN at bits 10..53: the physical
# address is the PPN shifted left by 12, the masked entry by 2.
RISCV64_ENTRIES = EntryFormat(((1 << 44) - 1) << 10, 0b1110, True, shift=2)


def levels(bits: int) -> int:
    """The levels of tables a virtual-address size takes (Sv39: 3, Sv48: 4, Sv57: 5)."""
    return (bits - 12) // 9


async def read_kernel(
    read: Reader, control: GuestTransport, ranges: Sequence[tuple[int, int]]
) -> list[bytes | None]:
    """``ranges`` of kernel memory through the vCPUs (``read``); what none of them read (each in
    user mode or in M-mode firmware: a guest paused so, or one whose vCPUs were there at each
    try), through a vCPU's own page tables walked in physical memory. QEMU translates a read as
    the vCPU's privilege would (user mode reads no supervisor page, M-mode translates nothing),
    but the tables are the same: riscv64 Linux maps the kernel in every process's tables
    (``pgd_alloc`` copies swapper_pg_dir's kernel half, arch/riscv/include/asm/pgalloc.h; no
    page-table isolation), and the satp of a vCPU in firmware is the one the kernel left."""
    found = await read(ranges)
    if all(data is not None for data in found):
        return found
    through = await satp_reader(control)
    if through is None:
        return found
    missing = [i for i, data in enumerate(found) if data is None]
    for i, data in zip(missing, await through([ranges[i] for i in missing]), strict=True):
        found[i] = data
    return found


async def satp_reader(control: GuestTransport) -> Reader | None:
    """Reads translated through the tables of the first vCPU whose satp translates (its
    registers' satp: ``info registers`` prints it), each range within one page; None when none
    does."""
    for cpu in await control.cpus():
        satp = (await control.registers(cpu)).special.get("satp", 0)
        bits = va_bits(satp)
        if bits is not None:
            break
    else:
        return None
    # Physical memory is the tables' "direct map" at 0: the root is satp's page, as it stands.
    tables = PageTables(physical_reader(control), 0, levels(bits), RISCV64_ENTRIES, 1 << (bits - 1))
    return tables.reader((satp & _PPN) << 12)


def physical_reader(control: GuestTransport) -> Reader:
    """Reads of physical memory."""

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        found = await control.read_physical(ranges)
        return [data if isinstance(data, bytes) else None for data in found]

    return read


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

    async def preload(self, read: Reader, cpus: Sequence[int], tries: int = PRELOAD_TRIES) -> None:
        return None  # no per-CPU base to read

    async def running(self, read: Reader) -> dict[int, int]:
        return {}  # the registers are read in a pause only

    def held(self, regs: Registers) -> int | None:
        found = self._kernel(regs.gprs.get(TP))
        return self._kernel(regs.special.get(SCRATCH)) if found is None else found

    async def pointer(self, read: Reader, regs: Registers, cache: PageCache) -> int | None:
        return self.held(regs)

    def _kernel(self, value: int | None) -> int | None:
        return value if value is not None and value >= self.arch.shared_from else None


@dataclass(frozen=True, slots=True)
class Riscv64Platform(NoOwnTables):
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

    async def page_tables(
        self, loaded: LoadedKernel, linear: LinearMap | None
    ) -> PageTables | None:
        """Walked in the linear map (``kernel_map.va_pa_offset`` above physical memory:
        ``linear_mapping_pa_to_va``, arch/riscv/include/asm/page.h), with the levels of the mode
        the kernel writes in satp (``satp_mode``: satp's MODE in its top 4 bits)."""
        mode_at = loaded.address("satp_mode")
        if linear is None or mode_at is None:
            return None
        (raw,) = await read_kernel(loaded.read, loaded.control, [(mode_at, 8)])
        bits = None if raw is None else va_bits(int.from_bytes(raw, "little"))
        if bits is None:
            return None
        return PageTables(
            loaded.read,
            linear.offset,
            levels(bits),
            RISCV64_ENTRIES,
            1 << (bits - 1),
            span=1 << bits,
        )

    def switch_layout(self, btf: Btf, arch: InstructionSet) -> SwitchLayout:
        return ThreadStruct.from_btf(btf, arch)

    def entry_code(self, kernel: LinuxKernel) -> ExceptionEntry | str | None:
        return entry_code(kernel)

    def current_task(
        self, arch: InstructionSet, clock: Callable[[], float], recheck: float
    ) -> CurrentTask | None:
        return RegisterTask(arch, clock, recheck)

    async def linear_map(self, loaded: LoadedKernel) -> LinearMap | None:
        """From ``kernel_map`` (arch/riscv/mm/init.c): RAM at ``page_offset``, ``va_pa_offset``
        above its physical address, up to the modules' 2 GiB below the image; the image at
        ``virt_addr``, ``va_kernel_pa_offset`` above its own. A vCPU in user mode reads no
        supervisor page, one in M-mode firmware translates nothing: such samples read the
        kernel's data physically through it (and it is read so too when every vCPU is there,
        ``read_kernel``)."""
        mapping, btf = loaded.address("kernel_map"), loaded.kernel.btf
        if btf is None or mapping is None:
            return None
        try:
            offsets = [btf.offset_of(f"kernel_mapping.{name}") for name in _MAPPING]
        except KeyError:
            return None
        places = [(mapping + offset, 8) for offset in offsets]
        raws = await read_kernel(loaded.read, loaded.control, places)
        if None in raws:
            return None
        found = [int.from_bytes(raw or b"", "little") for raw in raws]
        page_offset, va_pa_offset, virt_addr, size, image_offset = found
        image = (virt_addr, virt_addr + size, image_offset)
        return LinearMap(page_offset, virt_addr - (1 << 31), va_pa_offset, image)

    def kernel_walk(self, loaded: LoadedKernel) -> Callable[[int], Awaitable[int | None]] | None:
        return None

    async def kernel_root(self, loaded: LoadedKernel) -> int | None:
        return None

    @property
    def per_cpu_registers(self) -> tuple[str, ...]:
        return ()  # no register holds it: Linux reads __per_cpu_offset[cpu]

    def per_cpu_base(self, regs: Registers) -> int | None:
        return None

    def linear_map_end(self, arch: InstructionSet) -> int | None:
        return None


RISCV64 = Riscv64Platform()
