"""How a run is built, in one place: the transport, the guest identifier, the unwinder and the
sampler's configuration, from a RunSpec (what to profile and how). The command line (profile,
record, demo) and the benchmark build their runs here; nothing here prints or parses flags.

ELF files are loaded and indexed before the guest is touched, so a bad file fails before
anything is stopped, and nothing heavy is left for the first pause.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from qmpprof.dwarf.arch import I386, X86_64, Arch
from qmpprof.elf.image import ElfImage
from qmpprof.errors import MemoryReadError, UsageError
from qmpprof.guest import metadata
from qmpprof.guest.base import GuestIdentifier
from qmpprof.guest.cr3 import Cr3Identifier
from qmpprof.guest.emerald import EmeraldIdentifier
from qmpprof.guest.linux import LinuxIdentifier, TaskLayout, reader_of
from qmpprof.guest.linuxmodules import ModuleLayout, ModuleList, Reader
from qmpprof.guest.linuxpages import page_tables
from qmpprof.guest.linuxvma import VmaLayout
from qmpprof.guest.programs import ProgramIndex
from qmpprof.guest.userfiles import UserFiles
from qmpprof.linux.btf import Btf
from qmpprof.linux.kaslr import detect_slide
from qmpprof.linux.kernel import LinuxKernel, looks_like_linux
from qmpprof.memory import GDB_WINDOW, HMP_WINDOW
from qmpprof.model import KERNEL_BOUNDARY
from qmpprof.sampler import Sampler, SamplerConfig
from qmpprof.stats import SamplerStats
from qmpprof.transport.base import GuestTransport
from qmpprof.transport.privategdb import connect_fast
from qmpprof.transport.qmp import QmpTransport
from qmpprof.unwind.chain import AddressSpace, RawStack, Unwinder
from qmpprof.unwind.space import Module

# "auto": a private gdbstub opened over a local QMP socket when QEMU allows one, else QMP.
TransportKind = Literal["auto", "qmp", "gdb"]
TRANSPORTS: tuple[TransportKind, ...] = ("auto", "qmp", "gdb")
MemoryPath = Literal["auto", "memsave", "hmp"]
# How the guest tells its processes apart: "auto" is "linux" for a Linux kernel file, else it
# tries the Emerald page and falls back to CR3 for good once user code runs without one;
# "emerald" keeps looking for the page; "cr3" never; "linux" reads the current task_struct.
GuestOs = Literal["auto", "emerald", "cr3", "linux"]
GUEST_OSES: tuple[GuestOs, ...] = ("auto", "emerald", "cr3", "linux")
_L = TypeVar("_L")
# A 32-bit kernel's default boundary: the 3 GiB / 1 GiB split of i386 higher-half kernels.
KERNEL_BOUNDARY_32 = 0xC000_0000


def kernel_arch(kernel: Path | None) -> Arch:
    """The instruction set of the run: the kernel ELF's (x86_64 without one)."""
    return (None if kernel is None else ElfImage.sniff_arch(kernel)) or X86_64


def default_kernel_boundary(kernel: Path | None) -> int:
    """The kernel boundary when none is given: it follows the kernel ELF's class."""
    return KERNEL_BOUNDARY_32 if kernel_arch(kernel) is I386 else KERNEL_BOUNDARY


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything a run needs to be built. ``sampling.window`` is adjusted to the transport."""

    qmp_socket: Path = Path("./qmp-socket")
    qmp_tcp: tuple[str, int] | None = None
    transport: TransportKind = "auto"
    gdb: str | None = None  # gdbstub address, for the gdb transport
    memory: MemoryPath = "auto"
    kernel: Path | None = None
    kallsyms: Path | None = None  # a Linux kernel's System.map or /proc/kallsyms text
    user_dir: Path | None = None
    os: GuestOs = "auto"
    metadata_addr: int = metadata.METADATA_ADDR
    metadata_layout: tuple[str, ...] = metadata.FIELDS
    # Resolve source lines and inlined frames where DWARF has them (for --lines, and for saved
    # profiles, which any naming may render later); off, frames carry no lines (cheaper).
    lines: bool = False
    sampling: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)

    @property
    def where(self) -> str:
        """Where the guest is, as the user named it."""
        if self.transport == "gdb" and self.gdb is not None:
            return self.gdb
        if self.qmp_tcp is not None:
            return f"{self.qmp_tcp[0]}:{self.qmp_tcp[1]}"
        return str(self.qmp_socket)


def build_identifier(spec: RunSpec) -> GuestIdentifier[AddressSpace]:
    """The guest identifier over the kernel ELF and the programs of ``--user-dir``."""
    modules = []
    if spec.kernel is not None:
        modules.append(Module.from_image(ElfImage.load(spec.kernel).prepare(), kernel=True))
    programs = ProgramIndex.from_dir(spec.user_dir) if spec.user_dir else ProgramIndex([])
    for image in programs.images:
        image.prepare()
    # A 32-bit guest has no Emerald page (a 64-bit convention): "auto" means CR3 there.
    if spec.os == "cr3" or (spec.os == "auto" and kernel_arch(spec.kernel) is I386):
        return Cr3Identifier(modules, programs)
    return EmeraldIdentifier(
        modules,
        programs,
        metadata_addr=spec.metadata_addr,
        layout=spec.metadata_layout,
        fallback=spec.os == "auto",
    )


@dataclass(frozen=True, slots=True)
class Connection:
    """An open transport, how samples travel through it and what was learnt of the guest
    (lines for ``--verbose``), and ``notes``: what the user should be told in any case (a
    kernel without BTF, say), one line each."""

    transport: GuestTransport
    path: str
    detail: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


async def connect(spec: RunSpec) -> Connection:
    if spec.transport == "gdb":
        from qmpprof.transport.gdb import GdbTransport

        return Connection(await GdbTransport.connect(spec.gdb or ""), f"gdbstub at {spec.gdb}")
    if spec.transport == "auto":
        if spec.qmp_tcp is not None:
            transport, why = await connect_fast(tcp=spec.qmp_tcp, memory=spec.memory)
        else:
            transport, why = await connect_fast(spec.qmp_socket, memory=spec.memory)
        return Connection(transport, f"QMP ({why})" if why else "a private gdbstub opened over QMP")
    if spec.qmp_tcp is not None:
        transport = await QmpTransport.connect(tcp=spec.qmp_tcp, memory=spec.memory)
    else:
        transport = await QmpTransport.connect(spec.qmp_socket, memory=spec.memory)
    return Connection(transport, "QMP (--transport qmp)")


def sampler_config(spec: RunSpec, transport: GuestTransport) -> SamplerConfig:
    """The sampling configuration, its stack window fitted to what reads cost on
    ``transport``: memsave costs the same for 4 or 64 KiB, HMP x and the gdbstub by size."""
    if isinstance(transport, QmpTransport):
        window = HMP_WINDOW if transport.memory == "hmp" else spec.sampling.window
    else:
        window = GDB_WINDOW
    return dataclasses.replace(spec.sampling, window=min(window, spec.sampling.window))


def unwinder(spec: RunSpec) -> Unwinder:
    return Unwinder(
        kernel_boundary=spec.sampling.kernel_boundary,
        lines=spec.lines,
        arch=kernel_arch(spec.kernel),
    )


Run = Sampler[AddressSpace, RawStack]


def is_linux(spec: RunSpec) -> bool:
    """Whether the run is of a Linux guest: ``--os linux``, or a Linux kernel file under auto."""
    if spec.os == "linux":
        return True
    return spec.os == "auto" and spec.kernel is not None and looks_like_linux(spec.kernel)


def load_linux(spec: RunSpec) -> LinuxKernel:
    """The Linux kernel of the run, loaded and indexed (before the guest is touched)."""
    if spec.kernel is None:
        raise UsageError("--os linux needs --kernel (the vmlinuz or vmlinux the guest booted)")
    return LinuxKernel.load(spec.kernel, spec.kallsyms).prepare()


async def linux_identifier(
    spec: RunSpec, kernel: LinuxKernel, transport: GuestTransport
) -> tuple[LinuxIdentifier, tuple[str, ...], tuple[str, ...]]:
    """The identifier of a running Linux guest, with what a run says of it: (identifier,
    detail lines, note lines). Finds the KASLR slide through the transport's QMP side (the
    guest keeps running: HMP and memsave need no stop)."""
    control = getattr(transport, "control", transport)
    if not isinstance(control, QmpTransport):
        raise UsageError("a Linux guest needs QMP to find its KASLR slide: give --qmp-socket")
    slide = await detect_slide(control, kernel.symbols)
    notes = list(kernel.missing)

    def from_btf(make: Callable[[Btf], _L], lacking: str) -> _L | None:
        if kernel.btf is None:
            return None
        try:
            return make(kernel.btf)
        except KeyError as err:
            notes.append(f"this kernel's BTF lacks {err}: {lacking}")
            return None

    layout = from_btf(
        lambda btf: TaskLayout.from_btf(btf, kernel.symbols.address_of),
        "stacks without process names",
    )
    modules = [kernel.module(slide, lines=spec.lines)]
    head = kernel.address("modules", slide)
    module_layout = from_btf(ModuleLayout.from_btf, "module frames unnamed")
    module_list = None
    if module_layout is not None and head is not None:
        orc_layout = None if kernel.orc is None else kernel.orc.layout
        module_list = ModuleList(_reader(control), head, module_layout, orc_layout)
        modules += await module_list.refresh() or []
    per_cpu_offset = kernel.address("__per_cpu_offset", slide)
    vmas = from_btf(VmaLayout.from_btf, "user code is not placed")
    files = UserFiles(spec.user_dir)
    tables = await page_tables(
        reader_of(control, 0),
        kernel.address("page_offset_base", slide),
        kernel.address("__pgtable_l5_enabled", slide),
    )
    identifier = LinuxIdentifier(
        modules,
        layout,
        per_cpu_offset,
        vmas=vmas,
        files=files,
        module_list=module_list,
        control=control,
        tables=tables,
    )
    init_task = kernel.address("init_task", slide)
    if init_task is not None:
        await identifier.preload(control, init_task, await control.cpus())
    detail = (
        f"Linux kernel {kernel.path}: KASLR slide {slide:#x},"
        f" {len(modules) - 1} modules ({', '.join(m.name for m in modules[1:]) or 'none'})",
    )
    return identifier, detail, tuple(f"{kernel.path}: {note}" for note in notes)


def _reader(control: QmpTransport) -> Reader:
    async def read(addr: int, size: int) -> bytes | None:
        try:
            return await control.read(0, addr, size)
        except MemoryReadError:
            return None

    return read


async def start(
    spec: RunSpec,
    on_tick: Callable[[SamplerStats], None] | None = None,
    on_connect: Callable[[Connection], None] | None = None,
) -> Run:
    """A sampler connected to the guest, ready to run; the caller closes its transport.
    ``on_connect`` hears how samples travel and what was learnt of the guest, once connected.
    Files are loaded before the guest is touched: a bad one fails first."""
    linux = load_linux(spec) if is_linux(spec) else None
    identifier: GuestIdentifier[AddressSpace] | None = None
    if linux is None:
        identifier = build_identifier(spec)
    connection = await connect(spec)
    transport = connection.transport
    try:
        if linux is not None:
            identifier, detail, notes = await linux_identifier(spec, linux, transport)
            connection = dataclasses.replace(
                connection, detail=connection.detail + detail, notes=connection.notes + notes
            )
    except BaseException:
        await transport.close()
        raise
    assert identifier is not None
    if on_connect is not None:
        on_connect(connection)
    housekeeping = identifier.housekeep if isinstance(identifier, LinuxIdentifier) else None
    return Sampler(
        transport,
        unwinder(spec),
        identifier,
        sampler_config(spec, transport),
        on_tick=on_tick,
        housekeeping=housekeeping,
    )
