"""The transports qmpprof comes with, as the registry (``qmpprof.transport``) knows them: what
address each needs, how it is opened and told to the user, and its tuning (the stack window
worth reading at SP in one go over it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from qmpprof.errors import QmpprofError, TransportError
from qmpprof.model import Registers
from qmpprof.transport.base import Address, Forwarding, Opened, Reach
from qmpprof.transport.gdb import GdbTransport
from qmpprof.transport.privategdb import PrivateGdbTransport, connect_fast, fast_over
from qmpprof.transport.qmp import QmpTransport

# HMP ``x`` is formatting-bound: one page up front there (memsave costs about the same for 4
# or 64 KiB, so that path keeps the run's window).
HMP_WINDOW = 4096
# Over a gdbstub every 2 KiB is a packet QEMU answers in turn: a first window of two pages (or
# three, SP being mid-page) and more on demand, until a walk from that SP page has shown what
# it needs (memory.StackReader's cut).
GDB_WINDOW = 8192

_SILENT_STUB = (
    "the gdbstub did not say whether attaching stopped the guest (QEMU 8.1 and later never"
    " do): taken as paused; give the VM's --qmp-socket too and QMP says"
)


class GdbKind:
    """A gdbstub the VM has (``-gdb``), at the address the user gave; QMP, when a socket
    answers, says the run state before the stub attaches (which stops the guest)."""

    name = "gdb"
    needs = frozenset({Address.GDB})

    async def open(self, reach: Reach, passed_over: str | None) -> Opened:
        qmp = await _qmp_beside(reach.qmp_socket)
        try:
            was_running = None if qmp is None else await qmp.is_running()
            gdb = await GdbTransport.connect(reach.gdb or "", was_running=was_running)
        except BaseException:
            if qmp is not None:
                await qmp.close()
            raise
        notes = () if gdb.state_known else (_SILENT_STUB,)
        if qmp is None:
            return Opened(gdb, f"gdbstub at {reach.gdb}", notes, GDB_WINDOW)
        both = GdbBesideQmp(gdb, qmp)
        return Opened(both, f"gdbstub at {reach.gdb}, QMP beside it", notes, GDB_WINDOW)


class GdbBesideQmp(Forwarding):
    """The VM's own gdbstub for the samples, and QMP at the socket given beside it as the
    control channel: what a guest OS reads while the guest runs (a Linux guest's slide, its
    tasks and modules); it told the run state before the stub attached (QEMU 8.1 and later's
    stub does not say it), and tells the stub's channel whether the guest runs (``look_with``)."""

    def __init__(self, gdb: GdbTransport, qmp: QmpTransport) -> None:
        super().__init__(gdb)
        self._gdb, self._qmp = gdb, qmp
        gdb.look_with(qmp.is_running)

    @property
    def control(self) -> QmpTransport:
        return self._qmp

    async def stop_and_registers(self, cpus: Sequence[int]) -> list[Registers | TransportError]:
        return await self._gdb.stop_and_registers(cpus)

    async def close(self) -> None:
        """Detach (leaving the guest as it was found), then close QMP."""
        try:
            await self._gdb.close()
        finally:
            await self._qmp.close()


class PrivateGdbKind:
    """A private gdbstub opened over a local QMP socket (privategdb.py); QMP on the same
    connection when QEMU does not allow one."""

    name = "private-gdb"
    needs = frozenset({Address.QMP_SOCKET})

    async def open(self, reach: Reach, passed_over: str | None) -> Opened:
        transport, why = await connect_fast(reach.qmp_socket, memory=reach.memory)
        if isinstance(transport, PrivateGdbTransport):
            transport.control.guard_pauses()
            cleared = () if transport.cleared is None else (transport.cleared,)
            notes = (*_mark_notes(transport.control), *cleared)
            return Opened(transport, "a private gdbstub opened over QMP", notes, GDB_WINDOW)
        assert isinstance(transport, QmpTransport)  # connect_fast's other answer
        return _qmp_opened(transport, f"QMP ({why})")


class QmpKind:
    """QMP alone: registers from the monitor, memory by memsave or HMP ``x``."""

    name = "qmp"
    needs = frozenset({Address.QMP_SOCKET, Address.QMP_TCP})

    async def open(self, reach: Reach, passed_over: str | None) -> Opened:
        tcp = reach.qmp_tcp
        socket = None if tcp is not None else reach.qmp_socket
        transport = await QmpTransport.connect(socket, tcp, memory=reach.memory)
        try:
            await transport.take_mark()  # VmBusyError: another run holds the VM
        except BaseException:
            await transport.close()
            raise
        path = "QMP (--transport qmp)" if passed_over is None else f"QMP ({passed_over}: using QMP)"
        return _qmp_opened(transport, path)


class LibvirtKind:
    """A domain libvirt runs, by name: QMP through libvirt's monitor passthrough
    (libvirtdomain.py), and over it a private gdbstub as on a local QMP socket."""

    name = "libvirt"
    needs = frozenset({Address.DOMAIN})

    async def open(self, reach: Reach, passed_over: str | None) -> Opened:
        # Imported here: libvirt's binding is needed by this kind alone.
        from qmpprof.transport.libvirtdomain import DomainTransport

        qmp = await DomainTransport.open(reach.connect, reach.domain or "", memory=reach.memory)
        if qmp.host is not None:  # no gdbstub socket of its QEMU's is reachable from here
            try:
                await qmp.take_mark()
            except BaseException:
                await qmp.close()
                raise
            opened = _qmp_opened(qmp, "libvirt's monitor passthrough")
            said = (f"domain {qmp.name} runs on {qmp.host}: sampled through libvirt's monitor"
                    " passthrough alone, memory by HMP x (slower than a local domain)")  # fmt: skip
            return dataclasses.replace(opened, notes=(*opened.notes, said))
        transport, why = await fast_over(qmp)
        if isinstance(transport, PrivateGdbTransport):
            notes = _mark_notes(qmp) + (() if transport.cleared is None else (transport.cleared,))
            path = "a private gdbstub opened through libvirt's monitor passthrough"
            return Opened(transport, path, notes, GDB_WINDOW)
        return _qmp_opened(qmp, f"libvirt's monitor passthrough ({why})")


def _qmp_opened(qmp: QmpTransport, path: str) -> Opened:
    qmp.guard_pauses()
    window = HMP_WINDOW if qmp.memory == "hmp" else None
    return Opened(qmp, path, _mark_notes(qmp), window)


def _mark_notes(qmp: QmpTransport) -> tuple[str, ...]:
    """A dead run's mark this run replaced (vmmark.py), as a note."""
    return () if qmp.mark is None or qmp.mark.note is None else (qmp.mark.note,)


async def _qmp_beside(socket: Path) -> QmpTransport | None:
    """QMP at ``socket``, to tell the run state before a gdbstub attaches (which stops it) and
    to read while the guest runs; None when no QMP answers there."""
    if not socket.is_socket():
        return None
    try:
        return await QmpTransport.connect(socket, timeout=1.0)
    except QmpprofError:
        return None


async def quit_qemu(socket: Path, timeout: float) -> None:
    """HMP ``quit`` over the QMP socket ``socket``: GuestGoneError when QEMU closes the
    connection while quitting (what quit does), ConnectError when it cannot be reached."""
    qmp = await QmpTransport.connect(socket, timeout=timeout)
    try:
        await qmp.hmp("quit")
    finally:
        await qmp.close()
