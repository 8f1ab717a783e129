"""The seam between the sampler and QEMU: what any transport (QMP, gdbstub, a test fake) offers
(``GuestTransport``), how a run says where the guest is (``Reach``), what a kind of transport
declares to the registry (``TransportKind``) and what opening one gives (``Opened``)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from qmpprof.errors import MemoryReadError, TransportError
from qmpprof.model import Registers

# How QMP reads guest memory: memsave into a file, HMP ``x``, or the one the address suits.
MemoryPath = Literal["auto", "memsave", "hmp"]
AUTO = "auto"  # the transport the addresses and QEMU allow, in registry order


class GuestTransport(Protocol):
    """An open connection to one QEMU guest.

    Errors: ``GuestGoneError`` when QEMU went away, ``TransportError`` for a refused command,
    ``MemoryReadError`` when guest memory is not mapped.
    """

    async def is_running(self) -> bool:
        """True when the guest is running (QMP ``query-status``), False when paused."""
        ...

    async def stop(self) -> None: ...

    async def cont(self) -> None: ...

    async def cpus(self) -> list[int]:
        """Indexes of the guest's vCPUs."""
        ...

    async def registers(self, cpu: int) -> Registers: ...

    async def stop_and_registers(self, cpus: Sequence[int]) -> list[Registers | TransportError]:
        """``stop``, then each of ``cpus``' registers, or the TransportError its read raised
        (``each_registers``); a transport that can sends the reads with the stop, in one round
        trip (a gdbstub: QEMU stops the guest at ``\\x03`` before it reads what follows)."""
        ...

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        """Those of ``cpu``'s system registers ``names`` (as QEMU's gdbstub names them:
        ``TCR_EL1``) the transport can read, by name; the guest is left in the run state it
        had. QMP's monitor prints none of them."""
        ...

    async def read(self, cpu: int, addr: int, size: int) -> bytes:
        """Read guest-virtual memory as seen by ``cpu`` (its current page tables).

        ``addr`` is an unsigned 64-bit address; the read may span pages only if all are mapped.
        """
        ...

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        """Several ranges as ``cpu`` sees memory, in as few round trips as the transport can
        (a gdbstub: one): each range's bytes, or the MemoryReadError saying it is unmapped
        (with the bytes before the first unmapped page, ``readable``). Other errors raise."""
        ...

    async def read_physical(
        self, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        """Several ranges of guest-physical memory (no vCPU's translation), as ``read_many``
        returns them."""
        ...

    async def translate(self, cpu: int, addr: int) -> int | None:
        """The guest-physical address ``cpu``'s translation gives ``addr`` now (None: not
        mapped there). TransportError when the transport cannot ask (a gdbstub alone)."""
        ...

    @property
    def control(self) -> GuestTransport | None:
        """A channel that reads memory and registers while the guest runs, without stopping it
        (QMP's memsave and monitor), for what a guest OS learns between ticks; None when the
        transport has none (a gdbstub alone)."""
        ...

    async def close(self) -> None: ...


class Address(enum.Enum):
    """A kind of address a user can give for a guest."""

    QMP_SOCKET = "a QMP Unix socket"
    QMP_TCP = "QMP over TCP"
    GDB = "a gdbstub address"
    DOMAIN = "a libvirt domain"


@dataclass(frozen=True, slots=True)
class Reach:
    """Where the guest is and how the user asked to reach it, as they said it: the addresses,
    ``transport`` (a registry name, or ``auto``) and ``memory`` (how QMP reads memory)."""

    qmp_socket: Path = Path("./qmp-socket")
    qmp_tcp: tuple[str, int] | None = None
    gdb: str | None = None  # a gdbstub's address
    transport: str = AUTO
    memory: MemoryPath = "auto"
    domain: str | None = None  # a libvirt domain's name
    connect: str | None = None  # libvirt's URI for it (None: the one virsh would take)

    @property
    def addresses(self) -> frozenset[Address]:
        """The kinds of address given (a QMP socket is always, by default, unless a domain)."""
        if self.domain is not None:
            return frozenset({Address.DOMAIN})
        qmp = Address.QMP_SOCKET if self.qmp_tcp is None else Address.QMP_TCP
        return frozenset({qmp} if self.gdb is None else {qmp, Address.GDB})

    @property
    def where(self) -> str:
        """Where the guest is, as the user named it."""
        if self.transport == "gdb" and self.gdb is not None:
            return self.gdb
        if self.domain is not None:
            return f"domain {self.domain}"
        if self.qmp_tcp is not None:
            return f"{self.qmp_tcp[0]}:{self.qmp_tcp[1]}"
        return str(self.qmp_socket)


@dataclass(frozen=True, slots=True)
class BootFiles:
    """The files a VM boots directly as whoever runs it names them (a libvirt domain's XML:
    ``<kernel>``, ``<initrd>``), each None when not named or not readable on this host;
    ``notes``: why one named is not taken, one line each."""

    kernel: Path | None = None
    initrd: Path | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Opened:
    """An open transport, how samples travel through it (``path``, for ``--verbose``), what the
    user should be told in any case (``notes``, one line each), and its tuning: ``window``, the
    most stack bytes worth reading at SP in one go (None: no limit of its own)."""

    transport: GuestTransport
    path: str
    notes: tuple[str, ...] = ()
    window: int | None = None


class DomainSet(Protocol):
    """The running domains of a libvirt connection, as ``serve --libvirt`` follows them
    (libvirtwatch.py)."""

    def running(self) -> frozenset[str]: ...

    def close(self) -> None: ...


class TransportKind(Protocol):
    """A kind of transport, as the registry (``qmpprof.transport``) knows it: its ``--transport``
    name and the kinds of address it can use (any one of ``needs``)."""

    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> frozenset[Address]: ...

    async def open(self, reach: Reach, passed_over: str | None) -> Opened:
        """Connect to the guest at ``reach``. ``passed_over``: why the kinds before this one
        were not taken (``auto``), None when the user named this kind."""
        ...


class Forwarding:
    """A GuestTransport that hands every call to ``inner``: the base of a transport that changes
    a few of them (subclass it and override those), so that a member added to GuestTransport is
    forwarded here once for them all."""

    def __init__(self, inner: GuestTransport) -> None:
        self.inner = inner

    async def is_running(self) -> bool:
        return await self.inner.is_running()

    async def stop(self) -> None:
        await self.inner.stop()

    async def cont(self) -> None:
        await self.inner.cont()

    async def cpus(self) -> list[int]:
        return await self.inner.cpus()

    async def registers(self, cpu: int) -> Registers:
        return await self.inner.registers(cpu)

    async def stop_and_registers(self, cpus: Sequence[int]) -> list[Registers | TransportError]:
        """One after the other, through this transport's own ``stop`` and ``registers`` (a
        subclass that changes those may not send them together)."""
        await self.stop()
        return await each_registers(self, cpus)

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        return await self.inner.system_registers(cpu, names)

    async def read(self, cpu: int, addr: int, size: int) -> bytes:
        return await self.inner.read(cpu, addr, size)

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        return await self.inner.read_many(cpu, ranges)

    async def read_physical(
        self, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        return await self.inner.read_physical(ranges)

    async def translate(self, cpu: int, addr: int) -> int | None:
        return await self.inner.translate(cpu, addr)

    @property
    def control(self) -> GuestTransport | None:
        return self.inner.control

    async def close(self) -> None:
        await self.inner.close()


async def each_registers(
    transport: GuestTransport, cpus: Sequence[int]
) -> list[Registers | TransportError]:
    """Each of ``cpus``' registers, asked together, or the TransportError its read raised;
    any other error raises. A lone vCPU is awaited directly (a task costs event-loop turns in
    the middle of the guest's pause)."""
    if len(cpus) == 1:
        try:
            return [await transport.registers(cpus[0])]
        except TransportError as err:
            return [err]
    found = await asyncio.gather(*(transport.registers(c) for c in cpus), return_exceptions=True)
    for one in found:
        if isinstance(one, BaseException) and not isinstance(one, TransportError):
            raise one
    return [one for one in found if isinstance(one, Registers | TransportError)]
