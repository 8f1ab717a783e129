"""arm64's running Linux (``running.platform.LinuxPlatform``): the slide from the vector base
(VBAR_EL1, in every mode: a guest paused with every vCPU at EL0 too), or under KPTI at EL0 from
where the trampoline reads the kernel's vectors, else from where the image's banner reads (no
IDT); the kernel's own tables at TTBR1_EL1 (or where the trampoline moves it), the processes'
page tables walked in the linear map (4 KiB pages, the levels the user space's size needs), a
task off CPU's ``thread.cpu_context`` (``cpucontext``) and the exception entry code as its
vectors lead to it (``vectors``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from qmpprof.arch.aarch64 import AArch64, tnsz
from qmpprof.arch.base import InstructionSet
from qmpprof.linux import bannerslide
from qmpprof.linux.aarch64.cpucontext import CpuContext
from qmpprof.linux.aarch64.trampoline import swapper_offset, vectors_literal
from qmpprof.linux.aarch64.vectors import entry_code
from qmpprof.linux.btf import Btf
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.current import CurrentTask
from qmpprof.linux.running.linearmap import LinearMap
from qmpprof.linux.running.pagetables import AARCH64_ENTRIES, PageTables
from qmpprof.linux.running.platform import LoadedKernel, NoOwnTables
from qmpprof.linux.running.slide import slide_by_banner
from qmpprof.linux.running.switch import SwitchLayout
from qmpprof.memory import Reader, reader
from qmpprof.model import Registers
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.steps import ExceptionEntry

_VBAR = ("VBAR_EL1", "VBAR")  # the vector base register, by the names a gdbstub may give it
_LINEAR_BITS = 48  # VA_BITS_MIN of a 52-bit kernel (4 KiB or 16 KiB pages)
_BADDR = 0x0000_FFFF_FFFF_FFFE  # TTBR1_EL1's table address (48-bit physical addresses)
_EL0_SYNC = 0x400  # a vector table's entry for a synchronous exception from 64-bit EL0
_ENTRY_SIZE = 0x80  # bytes of a vector entry


@dataclass(frozen=True, slots=True)
class Aarch64Platform(NoOwnTables):
    name: str = "aarch64"

    async def slide(
        self,
        control: GuestTransport,
        kernel: LinuxKernel,
        arch: InstructionSet,
        transport: GuestTransport,
    ) -> int:
        found = await slide_by_vectors(control, transport, kernel, arch)
        if found is None:
            found = await slide_by_trampoline(control, transport, kernel, arch)
        return await slide_by_banner(control, kernel, arch) if found is None else found

    async def page_tables(
        self, loaded: LoadedKernel, linear: LinearMap | None
    ) -> PageTables | None:
        """4 KiB pages under a user space of ``arch.user_space_end`` bytes, walked in the linear
        map (a vCPU in kernel mode reads no user memory, PAN): 9 bits of address a level above
        the page's 12 (four levels for 48 bits)."""
        end = loaded.arch.user_space_end
        if linear is None or end is None:
            return None
        bits = end.bit_length() - 1
        return PageTables(loaded.read, linear.offset, -(-(bits - 12) // 9), AARCH64_ENTRIES, end)

    def switch_layout(self, btf: Btf, arch: InstructionSet) -> SwitchLayout:
        return CpuContext.from_btf(btf, arch)

    def entry_code(self, kernel: LinuxKernel) -> ExceptionEntry | str | None:
        return entry_code(kernel)

    def current_task(
        self, arch: InstructionSet, clock: Callable[[], float], recheck: float
    ) -> CurrentTask | None:
        return None

    async def linear_map(self, loaded: LoadedKernel) -> LinearMap | None:
        return None

    def kernel_walk(self, loaded: LoadedKernel) -> Callable[[int], Awaitable[int | None]] | None:
        """The kernel's tables (``kernel_root``) walked in physical memory with 4 KiB pages over
        the 64 - T1SZ bits of the kernel's half: a vCPU at EL0 translates no kernel address
        (E0PD, KPTI)."""
        tables = _kernel_tables(loaded)
        if tables is None:
            return None
        root: list[int | None] = []

        async def walk(addr: int) -> int | None:
            if not root:
                root.append(await self.kernel_root(loaded))
            return (
                None
                if root[0] is None
                else await tables.physical(root[0], addr & (tables.span - 1))
            )

        return walk

    async def kernel_root(self, loaded: LoadedKernel) -> int | None:
        """The first vCPU's TTBR1_EL1's table (its BADDR, bits 47..1: the ASID above, CnP in
        bit 0) where it maps the kernel's text: the kernel's own tables at EL1, and at EL0
        where E0PD rather than KPTI hides them (QEMU 7.2's -cpu max, seen on bookworm's
        6.12); else the table KPTI's trampoline moves it to (``trampoline``: at EL0 it holds
        the trampoline's tables, seen on bookworm's 6.1). None over a transport without
        system registers, or where neither maps the kernel's text."""
        tables, ttbr1 = _kernel_tables(loaded), loaded.registers.get("TTBR1_EL1")
        if tables is None or ttbr1 is None:
            return None
        base = ttbr1 & _BADDR
        text = loaded.address("_stext") or loaded.address("_text")
        if text is None:
            return base
        if await tables.physical(base, text & (tables.span - 1)) is not None:
            return base
        offset = swapper_offset(loaded.kernel.image.text_bytes)
        if offset is None or await tables.physical(base + offset, text & (tables.span - 1)) is None:
            return None
        return base + offset

    @property
    def per_cpu_registers(self) -> tuple[str, ...]:
        # Linux's this-CPU offset, at EL1 (a kernel at EL2 under VHE keeps it in TPIDR_EL2).
        return ("TPIDR_EL1",)

    def per_cpu_base(self, regs: Registers) -> int | None:
        return None  # TPIDR_EL1 holds it (per_cpu_registers), not among the sampled ones

    def linear_map_end(self, arch: InstructionSet) -> int | None:
        """Linux's PAGE_END, _PAGE_END(VA_BITS_MIN): the linear map is the lower half of the
        kernel's space, of at most 48 bits (a 52-bit kernel keeps its modules, vmalloc area
        and image where a 48-bit one has them: 0xffff800000000000 up); None before TCR_EL1's
        T1SZ is known."""
        t1sz = arch.t1sz if isinstance(arch, AArch64) else None
        if t1sz is None:
            return None
        return (1 << 64) - (1 << (min(64 - t1sz, _LINEAR_BITS) - 1))


async def slide_by_vectors(
    control: GuestTransport, transport: GuestTransport, kernel: LinuxKernel, arch: InstructionSet
) -> int | None:
    """The slide the first vCPU's VBAR_EL1 gives (read through ``transport``: the control
    channel has no system registers): where the kernel put its vector table (``vectors``)
    less where the image links it, a slide's alignment (``bannerslide.ALIGN``), unless the
    image's banner reads otherwise there through that vCPU (``control``). A vCPU at EL0 sees
    no kernel (E0PD, KPTI): its banner does not read, and the vector base alone says it.
    None: no such register over this transport, no ``vectors`` or banner, or a vector base
    that is not the image's."""
    vectors, banner = kernel.symbols.address_of("vectors"), bannerslide.banner(kernel.image)
    cpus = await control.cpus()
    if vectors is None or banner is None or not cpus:
        return None
    # QEMU's gdbstub names it VBAR (one register of both AArch32 and AArch64 in its tables;
    # checked on QEMU 7.2), a stub that follows the Arm ARM VBAR_EL1.
    found = await transport.system_registers(cpus[0], _VBAR)
    vbar = next((found[name] for name in _VBAR if name in found), None)
    if vbar is None:
        return None
    slide = (vbar - vectors) & arch.mask
    if slide % bannerslide.ALIGN or kernel.span[1] + slide > arch.mask:
        return None  # not where the kernel can be placed (KPTI's trampoline alias)
    link, text = banner
    (seen,) = await reader(control, cpus[0])([((link + slide) & arch.mask, len(text))])
    return slide if seen in (text, None) else None


async def slide_by_trampoline(
    control: GuestTransport, transport: GuestTransport, kernel: LinuxKernel, arch: InstructionSet
) -> int | None:
    """The slide KPTI's trampoline gives, the first vCPU at EL0: its VBAR_EL1 holds the
    trampoline's vectors, whose entry for an exception from 64-bit EL0 loads the kernel's
    ``vectors`` from a literal (``trampoline.vectors_literal``) once it has moved TTBR1_EL1 to
    the kernel's tables (``trampoline.swapper_offset``): the entry read through the
    trampoline's tables (TTBR1_EL1, walked physically), the literal through the kernel's; that
    address less where the image links ``vectors``. None over a transport without system
    registers, or where the registers lead to no such literal (no KPTI, or a vCPU in the
    kernel)."""
    vectors, cpus = kernel.symbols.address_of("vectors"), await control.cpus()
    if vectors is None or not cpus:
        return None
    found = await transport.system_registers(cpus[0], (*_VBAR, "TTBR1_EL1", "TCR_EL1"))
    vbar = next((found[name] for name in _VBAR if name in found), None)
    ttbr1, tcr = found.get("TTBR1_EL1"), found.get("TCR_EL1")
    if vbar is None or ttbr1 is None or tcr is None:
        return None
    tables = _tables(control, tcr)
    physical = _physical(control)

    async def through_tables(root: int, addr: int, size: int) -> bytes | None:
        place = await tables.physical(root, addr & (tables.span - 1))
        return None if place is None else (await physical([(place, size)]))[0]

    entry, root = (vbar + _EL0_SYNC) & arch.mask, ttbr1 & _BADDR
    code = await through_tables(root, entry, _ENTRY_SIZE)
    literal = None if code is None else vectors_literal(code, entry)
    # The literal is read once the kernel is mapped: through the kernel's tables.
    offset = None if literal is None else swapper_offset(kernel.image.text_bytes)
    value = None
    if literal is not None and offset is not None:
        value = await through_tables(root + offset, literal, 8)
    if value is None or len(value) != 8:
        return None
    slide = (int.from_bytes(value, "little") - vectors) & arch.mask
    if slide % bannerslide.ALIGN or kernel.span[1] + slide > arch.mask:
        return None
    return slide


def _kernel_tables(loaded: LoadedKernel) -> PageTables | None:
    """The kernel half's tables as TCR_EL1 sizes them (64 - T1SZ bits), walked in physical
    memory; None without TCR_EL1."""
    tcr = loaded.registers.get("TCR_EL1")
    return None if tcr is None else _tables(loaded.control, tcr)


def _tables(control: GuestTransport, tcr: int) -> PageTables:
    """The kernel half's tables under TCR_EL1 ``tcr``, walked in physical memory."""
    bits = 64 - tnsz(tcr)[1]
    levels = -(-(bits - 12) // 9)
    return PageTables(_physical(control), 0, levels, AARCH64_ENTRIES, 1 << bits)


def _physical(control: GuestTransport) -> Reader:
    """Guest-physical memory as a Reader (None where a range does not read)."""

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        found = await control.read_physical(ranges)
        return [data if isinstance(data, bytes) else None for data in found]

    return read


AARCH64 = Aarch64Platform()
