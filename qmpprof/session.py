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
from typing import Literal

from qmpprof.elf.image import ElfImage
from qmpprof.guest import metadata
from qmpprof.guest.base import GuestIdentifier
from qmpprof.guest.cr3 import Cr3Identifier
from qmpprof.guest.emerald import EmeraldIdentifier
from qmpprof.guest.programs import ProgramIndex
from qmpprof.memory import HMP_WINDOW
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
# How the guest tells its processes apart: "auto" tries the Emerald page and falls back to CR3
# for good once user code runs without one; "emerald" keeps looking for the page; "cr3" never.
GuestOs = Literal["auto", "emerald", "cr3"]
GUEST_OSES: tuple[GuestOs, ...] = ("auto", "emerald", "cr3")


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything a run needs to be built. ``sampling.window`` is adjusted to the transport."""

    qmp_socket: Path = Path("./qmp-socket")
    qmp_tcp: tuple[str, int] | None = None
    transport: TransportKind = "auto"
    gdb: str | None = None  # gdbstub address, for the gdb transport
    memory: MemoryPath = "auto"
    kernel: Path | None = None
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
    if spec.os == "cr3":
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
    """An open transport, and how samples travel through it (one line, for ``--verbose``)."""

    transport: GuestTransport
    path: str


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
    hmp = isinstance(transport, QmpTransport) and transport.memory == "hmp"
    if hmp and spec.sampling.window > HMP_WINDOW:
        return dataclasses.replace(spec.sampling, window=HMP_WINDOW)
    return spec.sampling


def unwinder(spec: RunSpec) -> Unwinder:
    return Unwinder(kernel_boundary=spec.sampling.kernel_boundary, lines=spec.lines)


Run = Sampler[AddressSpace, RawStack]


async def start(
    spec: RunSpec,
    on_tick: Callable[[SamplerStats], None] | None = None,
    on_connect: Callable[[str], None] | None = None,
) -> Run:
    """A sampler connected to the guest, ready to run; the caller closes its transport.
    ``on_connect`` hears how samples travel (``Connection.path``) once connected."""
    identifier = build_identifier(spec)  # ELF errors before touching the guest
    connection = await connect(spec)
    if on_connect is not None:
        on_connect(connection.path)
    transport = connection.transport
    return Sampler(
        transport, unwinder(spec), identifier, sampler_config(spec, transport), on_tick=on_tick
    )
