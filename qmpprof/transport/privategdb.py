"""The fast path for a VM reached through a local QMP socket: a private gdbstub opened over QMP.

Given only the QMP socket, qmpprof asks QEMU for a gdbstub on a Unix socket inside a directory
only we can enter, drives stop, registers, memory and continue through it (a gdbstub packet
costs a tenth of a QMP command), keeps QMP open as the control channel and the witness of the
run state, and removes the stub whichever way the run ends. ``connect_fast`` decides whether
that path can be taken and, when it cannot, says why in one line.

Facts about QEMU 7.2 this relies on (measured; tests/e2e/test_transport_privategdb.py):

- HMP ``gdbserver unix:PATH,server=on,wait=off`` answers "Waiting for gdb connection on device
  ..." and adds a chardev labelled ``gdb``. A failure is a *successful* reply holding QEMU's
  error text ("Failed to bind socket ...", "duplicate yank instance" when the VM has a stub).
- The socket file is created 0755: the 0700 directory is what keeps other local users out.
- ``gdbserver none`` removes the chardev, hangs up on a connected client and deletes the socket
  file; the VM's run state is left as it is (a VM the stub had stopped stays paused). The first
  ``gdbserver`` also makes a chardev for gdb's ``monitor`` command (filename ``gdb``, label
  ``#chrN``), which QEMU keeps and reuses for the rest of its life: that one is not the stub.
- The stub's query-chardev filename is ``unix:PATH,server=on`` while a client is connected,
  ``disconnected:unix:PATH,server=on`` otherwise.

A stub a qmpprof killed outright left behind is recognised and removed before the next run
opens its own (transport/stubdir.py); when QMP went away but QEMU lives on, ``close`` removes
the stub over a new QMP connection, or leaves the directory for the next run to recognise.
- Connecting stops the VM (QMP status ``paused``); the stub's ``c`` and ``D`` resume it, ``c``
  also starts a VM still in ``prelaunch`` (``-S``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from qmpprof.errors import ConnectError, GuestHeldError, QmpprofError, TransportError
from qmpprof.model import Registers
from qmpprof.transport.base import Forwarding, GuestTransport, MemoryPath
from qmpprof.transport.gdb import GdbTransport
from qmpprof.transport.qmp import QmpTransport
from qmpprof.transport.stubdir import StubDir, leftover, listening

_T = TypeVar("_T")
_STUB_LABEL = "gdb"  # the chardev QEMU names its gdbstub, however it was started
_LISTENING = "Waiting for gdb connection"
# States a QMP cont resumes from; others (shutdown, guest-panicked, ...) it must not touch.
_STOPPED = ("paused", "debug", "prelaunch")


async def connect_fast(
    socket_path: str | os.PathLike[str],
    *,
    memory: MemoryPath = "auto",
    timeout: float = 5.0,
) -> tuple[GuestTransport, str | None]:
    """Connect to QEMU through QMP and take the fast path when it is there to take.

    Returns the transport and None when it runs through a private gdbstub, or a QmpTransport
    and the one-line reason it does not (for ``--verbose``). Arguments as
    ``QmpTransport.connect``; ``memory`` applies to the QMP path only. Raises ConnectError
    when QMP itself cannot be reached, VmBusyError when another qmpprof holds the VM (the
    VM's mark, vmmark.py: taken before anything else, removed when QMP closes).
    """
    qmp = await QmpTransport.connect(socket_path, memory=memory, timeout=timeout)
    return await fast_over(qmp, timeout)


async def fast_over(qmp: QmpTransport, timeout: float = 5.0) -> tuple[GuestTransport, str | None]:
    """``connect_fast`` on a QMP connection already open (``qmp``: closed when this raises)."""
    try:
        await qmp.take_mark()  # VmBusyError: another run holds the VM
        cleared = None
        qmp.guard_pauses()  # from here: attaching the stub stops the guest
        stub = (await qmp.chardevs()).get(_STUB_LABEL)
        if stub is not None:
            left = leftover(stub)
            if left is None:
                return qmp, f"the VM already has a gdbstub (chardev gdb): using QMP; {_own(stub)}"
            await _remove_leftover(qmp, left)
            cleared = f"removed the gdbstub a qmpprof killed outright had left ({left.socket})"
        transport = await PrivateGdbTransport._open(qmp, timeout)
        transport.cleared = cleared
        return transport, None
    except _NoFastPath as why:
        return qmp, f"{why}: using QMP"
    except BaseException:
        await qmp.close()
        raise


def _own(filename: str) -> str:
    """What to pass to sample through the VM's own gdbstub, whose query-chardev ``filename``
    is given: ``tcp:HOST:PORT,server=on``, ``unix:PATH,server=on``, ``disconnected:`` before
    either while no client is on it, a connected one's peer after a comma (QEMU 7.2's and 11.1's
    char-socket filenames)."""
    free = filename.startswith("disconnected:")
    kind, _, rest = filename.removeprefix("disconnected:").partition(":")
    where = rest.split(",")[0]
    if kind == "tcp" and ":" in where:
        host, _, port = where.rpartition(":")
        host = "localhost" if host.strip("[]") in ("", "0.0.0.0", "::") else host
        address = f"{host}:{port}"
    elif kind == "unix" and where:
        address = f"unix:{where}"
    else:
        return "pass --gdb ADDRESS to use it"
    return f"pass --gdb {address} to use it" + ("" if free else " once its client leaves")


async def _remove_leftover(qmp: QmpTransport, left: StubDir) -> None:
    try:
        await qmp.hmp("gdbserver none")
    except BaseException:
        left.release()  # still there for the next run to recognise
        raise
    left.remove()


class _NoFastPath(Exception):
    """The private gdbstub could not be set up; QMP alone still works. Message: why."""


class PrivateGdbTransport(Forwarding):
    """A GuestTransport over a gdbstub qmpprof opened through QMP and removes when it closes:
    the stub's, but for the run state (QMP's word) and translation (QMP's).

    Open it with ``connect_fast``. The guest's run state before qmpprof touched it is restored
    by ``close``, which is safe to call twice, after QEMU went away and from a cancelled task.
    """

    def __init__(
        self,
        qmp: QmpTransport,
        gdb: GdbTransport,
        directory: StubDir,
        was_running: bool,
        timeout: float,
    ) -> None:
        super().__init__(gdb)
        self._qmp = qmp
        self._gdb = gdb
        gdb.look_with(qmp.is_running)
        self._directory = directory
        self.was_running = was_running  # the run state to leave the guest in
        self._timeout = timeout
        self._closed = False
        self.cleared: str | None = None  # a note: the leftover stub removed before this one
        self._resumed = was_running  # resumed by us (GdbTransport.connect resumes a running one)
        self._held = False  # something else stopped the guest: its run state is not ours

    @classmethod
    async def _open(cls, qmp: QmpTransport, timeout: float) -> PrivateGdbTransport:
        """Start a gdbstub in a new 0700 directory and attach to it. On failure everything made
        so far is undone and ``_NoFastPath`` says why; ``qmp`` stays open either way."""
        try:
            directory = StubDir.make()
        except OSError as err:
            raise _NoFastPath(f"cannot make a private directory: {err}") from err
        path = directory.socket
        was_running: bool | None = None
        asked = False  # QEMU may have opened the stub (a reply cancelled in flight counts)
        try:
            was_running = await qmp.is_running()
            if was_running:
                qmp.pausing()  # the attach stops it until the stub's connect resumes it
            asked = True
            reply = await qmp.hmp(f"gdbserver unix:{path},server=on,wait=off")
            if not reply.startswith(_LISTENING):
                asked = False  # refused: the VM's stub, if any, is not ours to remove
                raise _NoFastPath(f"QEMU refused a gdbstub: {_first_line(reply)}")
            try:
                gdb = await GdbTransport.connect(
                    path, was_running=was_running, timeout=timeout, formats=qmp.formats
                )
            except ConnectError as err:
                # QEMU made the socket where we cannot reach it (another mount namespace), or
                # attached and then did not answer: the attach may have stopped the guest.
                raise _NoFastPath(f"cannot attach to the gdbstub QEMU opened: {err}") from err
        except BaseException:
            await _undo(qmp, directory, timeout, stub=asked, running=was_running)
            qmp.settled()  # as it was found, or as well as QMP could put it back
            raise
        if was_running:
            qmp.settled()
        return cls(qmp, gdb, directory, was_running, timeout)

    @property
    def control(self) -> QmpTransport:
        """The QMP control channel: HMP, and memory reads that need no stop (memsave)."""
        return self._qmp

    @property
    def directory(self) -> str:
        """The private directory holding the gdbstub's socket (gone once closed)."""
        return self._directory.path

    async def is_running(self) -> bool:
        """QMP's word (query-status). A guest something else resumed is noted, so that the next
        stop interrupts it."""
        running = await self._qmp.is_running()
        if running:
            self._gdb.note_resumed()
        return running

    async def stop(self) -> None:
        await self._check_stopped_elsewhere()
        self._qmp.pausing()
        await self._gdb.stop()

    async def cont(self) -> None:
        await self._gdb.cont()
        self._resumed = True
        self._qmp.settled()

    async def stop_and_registers(self, cpus: Sequence[int]) -> list[Registers | TransportError]:
        """Stop and read the registers of ``cpus`` in one round trip (see GdbTransport)."""
        await self._check_stopped_elsewhere()
        self._qmp.pausing()
        return await self._gdb.stop_and_registers(cpus)

    async def _check_stopped_elsewhere(self) -> None:
        """Before a stop: the stub sent a stop reply since our ``c`` (something else stopped
        the guest: QMP, another client). What QMP says now decides: running again (resumed
        behind the stub's back), the stub must be interrupted, as a packet sent to a running
        guest is lost (gdbchannel.py); still stopped, the pause is another's: GuestHeldError,
        and the guest is left so, now and when the transport closes."""
        if not self._gdb.stopped or not self._resumed:
            return
        status = await self._qmp.status()
        if status == "running":
            self._gdb.note_resumed()
            return
        self._held = True
        raise GuestHeldError(status)

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        """Stopped through the stub, resumed through QMP: QMP's ``cont`` returns once the guest
        runs, so the next query-status says so (the stub's ``c`` goes unanswered). In a pause
        the stub made, read at once, as memory is (QMP's query-status cost 0.5-1 ms of it)."""
        if self._gdb.stopped:
            return await self._gdb.read_system_registers(cpu, names)
        running = await self.is_running()
        await self._gdb.stop()
        try:
            return await self._gdb.read_system_registers(cpu, names)
        finally:
            if running:
                await self._qmp.cont()
                self._gdb.note_resumed()

    async def translate(self, cpu: int, addr: int) -> int | None:
        return await self._qmp.translate(cpu, addr)

    async def hmp(self, command: str, cpu: int | None = None) -> str:
        """A human monitor command over the QMP control channel."""
        return await self._qmp.hmp(command, cpu)

    async def status(self) -> str:
        """QEMU's run state name over QMP (running, paused, ...)."""
        return await self._qmp.status()

    async def close(self, *, running: bool | None = None) -> None:
        """Detach, remove the gdbstub and its directory, close QMP, leaving the guest running if
        ``running`` (default: in the run state it was found in). Errors from a QEMU that went
        away are dropped; a cancellation is raised at the end, after every step was tried.

        Should the QMP connection be gone while QEMU still listens on the stub's socket, a new
        QMP connection removes the stub; failing that, the directory is left (unlocked) for the
        next run to recognise as a leftover."""
        if self._closed:
            return
        self._closed = True
        keep_running: bool | None = self.was_running if running is None else running
        if self._held:
            keep_running = None  # as the other client left it
        await _undo(
            self._qmp,
            self._directory,
            self._timeout,
            stub=True,
            running=keep_running,
            detach=self._gdb.close(running=keep_running),
        )

    async def __aenter__(self) -> PrivateGdbTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _undo(
    qmp: QmpTransport,
    directory: StubDir,
    timeout: float,
    *,
    stub: bool,
    running: bool | None,
    detach: Awaitable[object] | None = None,
) -> None:
    """Undo what was opened in QEMU: ``detach`` (the gdbstub client), the stub (if ``stub``),
    the run state (unless ``running`` is None), each step tried whatever the last did; QMP is
    closed after them when a run closes (``detach`` given: a failed open keeps it, for the QMP
    path).

    Should the QMP connection be gone while QEMU still listens on the stub's socket, a new QMP
    connection removes the stub; failing that, the directory is left (unlocked) for the next
    run to recognise as a leftover (stubdir.py). Otherwise the directory is removed."""
    removed = not stub

    async def remove_stub(channel: QmpTransport) -> None:
        nonlocal removed
        await channel.hmp("gdbserver none")
        removed = True

    async def over_a_new_connection() -> None:
        channel = await qmp.reconnect(timeout=timeout)
        try:
            await remove_stub(channel)
            if running is not None:
                await _restore_run_state(channel, running)
        finally:
            await channel.close()

    steps: list[Awaitable[object]] = [] if detach is None else [detach]
    if stub:
        steps.append(remove_stub(qmp))
    if running is not None:
        # QMP has the last word: a refused detach must not leave the run state changed.
        steps.append(_restore_run_state(qmp, running))
    if detach is not None:
        steps.append(qmp.close())
    try:
        await _finish(steps, timeout)
        if not removed and listening(directory.socket):
            await _finish([over_a_new_connection()], timeout)
    finally:
        if removed or not listening(directory.socket):
            directory.remove()
        else:
            directory.release()


async def _restore_run_state(qmp: QmpTransport, running: bool) -> None:
    status = await qmp.status()
    if running and status in _STOPPED:
        await qmp.cont()
    elif not running and status == "running":
        await qmp.stop()
        qmp.settled()  # stopped as the user had it: nothing owed


async def _finish(steps: Sequence[Awaitable[object]], timeout: float) -> None:
    """Run every cleanup step in order, each bounded in time. A step failing (QEMU gone, a
    refusal, no answer) does not stop the next, and its error is dropped: the caller is
    closing, or already raising a better one. A cancellation does not stop the next step
    either, but is raised once all were tried."""
    cancelled: asyncio.CancelledError | None = None
    for step in steps:
        try:
            await _bounded(step, timeout)
        except asyncio.CancelledError as err:
            cancelled = cancelled or err
        except (QmpprofError, TimeoutError, OSError):
            pass
    if cancelled is not None:
        raise cancelled


async def _bounded(step: Awaitable[_T], seconds: float) -> _T:
    """``step`` within ``seconds``: cleanup must not hang on a QEMU that stopped answering."""
    async with asyncio.timeout(seconds):
        return await step


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no reply"
