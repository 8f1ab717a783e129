"""GuestTransport over QMP, with qemu.qmp's asyncio client (the only module importing qemu.qmp).

Registers come from HMP ``info registers`` (``human-monitor-command`` with ``cpu-index``), read
by the register formats of QEMU's target (``query-target``, ``qmpprof.arch``'s registry).
Memory comes from QMP ``memsave`` into a private file when QEMU shares our filesystem (a Unix
socket), else from HMP ``x/Ngx`` (QMP over TCP: assume QEMU's filesystem is not ours). The
automatic choice falls back to ``x`` for good when ``memsave`` cannot write our file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

from qemu.qmp import ConnectError as QmpConnectError
from qemu.qmp import ExecInterruptedError, ExecuteError, Message, QMPClient, QMPError, StateError
from qemu.qmp.qmp_client import GreetingError, NegotiationError

import qmpprof.transport.hmp as hmp
import qmpprof.transport.vmmark as vmmark
from qmpprof import arch
from qmpprof.arch.base import RegisterFormats
from qmpprof.errors import (
    ConnectError,
    GuestGoneError,
    GuestHeldError,
    MemoryReadError,
    TransportError,
)
from qmpprof.model import Registers
from qmpprof.transport.base import MemoryPath, each_registers
from qmpprof.transport.guard import PauseGuard

_GONE = (ExecInterruptedError, StateError, EOFError, ConnectionError)
_INVALID_ADDR = "Invalid addr"
_SHM = "/dev/shm"
_SESSION_TRIES = 3  # connections tried when an event came in the way of the negotiation
_MARK_WITHIN = 1.0  # seconds the end of a run gives the removal of its mark
# memsaves in flight at once, each with a file of its own: a read of thousands of ranges (a
# process's 65,530 mappings) waits for a free file rather than opening one per range, and QEMU
# answers one command at a time anyway.
MEMSAVES_AT_ONCE = 32


class MonitorClient(Protocol):
    """What QmpTransport needs of a QMP client: qemu.qmp's, or one that passes QMP commands
    through another owner of the monitor (libvirt.py). ``stops``: STOP events seen so far."""

    stops: int

    async def execute(self, cmd: str, arguments: Mapping[str, object] | None = None) -> object:
        """The command's reply; TransportError or GuestGoneError (qemu.qmp's own errors from
        qemu.qmp's client, which ``_execute`` turns into those)."""
        ...

    async def disconnect(self) -> None: ...


class QmpTransport:
    """An open QMP session with one QEMU. Create it with ``await QmpTransport.connect(...)``."""

    def __init__(
        self,
        client: MonitorClient,
        memory: Literal["memsave", "hmp"],
        auto: bool,
        formats: RegisterFormats,
        address: str | tuple[str, int],
    ) -> None:
        self._client = client
        self.address = address  # where QEMU was reached: a socket path, or (host, port)
        self.guard: PauseGuard | None = None  # resumes the guest should qmpprof die in a pause
        self.mark: vmmark.Mark | None = None  # this run's mark in the VM, removed by close
        self.formats = formats
        self.memory: Literal["memsave", "hmp"] = memory
        self._auto = auto
        self._dump_dir: str | None = None
        # One file per read in flight (reads are pipelined), reused: free files wait here.
        self._free_dumps: list[tuple[str, int]] = []
        self._all_dumps: list[int] = []
        self._dump_slots = asyncio.Semaphore(MEMSAVES_AT_ONCE)
        # tmpfs when there is one: on ext4, rewriting a truncated file costs QEMU ~0.3 ms more
        # per memsave (the close flushes it). None: the ordinary temp directory.
        self._dump_root: str | None = _SHM if os.access(_SHM, os.W_OK) else None

    @classmethod
    async def connect(
        cls,
        socket_path: str | os.PathLike[str] | None = None,
        tcp: tuple[str, int] | None = None,
        *,
        memory: MemoryPath = "auto",
        timeout: float = 5.0,
    ) -> QmpTransport:
        """Connect and negotiate; ConnectError (one clear line) when that is not possible."""
        if (socket_path is None) == (tcp is None):
            raise ValueError("give exactly one of socket_path and tcp")
        where = f"{tcp[0]}:{tcp[1]}" if tcp is not None else str(socket_path)
        if socket_path is not None and not Path(socket_path).exists():
            raise ConnectError(f"no QMP socket at {where} (is QEMU running with -qmp unix:...?)")
        address: str | tuple[str, int] = tcp if tcp is not None else os.fspath(socket_path or "")
        client = await _negotiated(address, where, timeout)
        chosen: Literal["memsave", "hmp"] = "hmp" if tcp is not None else "memsave"
        if memory != "auto":
            chosen = memory
        try:
            formats = await register_formats(client, where)
        except BaseException:
            await _quiet_disconnect(client)
            raise
        return cls(client, chosen, auto=memory == "auto", formats=formats, address=address)

    async def reconnect(self, *, timeout: float = 5.0) -> QmpTransport:
        """A new connection to the same QEMU (this one's memory path): another QMP session."""
        memory: MemoryPath = "auto" if self._auto else self.memory
        if isinstance(self.address, tuple):
            return await QmpTransport.connect(tcp=self.address, memory=memory, timeout=timeout)
        return await QmpTransport.connect(self.address, memory=memory, timeout=timeout)

    async def _execute(self, cmd: str, args: dict[str, object] | None = None) -> object:
        try:
            return await self._client.execute(cmd, args)
        except ExecuteError as err:
            raise TransportError(f"QEMU refused {cmd}: {err}") from err
        except _GONE as err:
            raise GuestGoneError("QEMU closed the QMP connection") from err
        except QMPError as err:
            raise TransportError(f"{cmd}: {err}") from err

    async def command(self, name: str, args: dict[str, object]) -> object:
        """Any QMP command: its reply, or TransportError when QEMU refuses it."""
        return await self._execute(name, args)

    async def take_mark(self) -> str | None:
        """Mark the VM as this run's (vmmark.py), before anything touches the guest: VmBusyError
        when another run holds it. Returns a note when a dead run's mark was replaced."""
        address = self.address
        where = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
        self.mark = await vmmark.take(self, where)
        return self.mark.note

    async def hmp(self, command: str, cpu: int | None = None) -> str:
        """Run a human monitor command (on vCPU ``cpu``) and return its text."""
        args: dict[str, object] = {"command-line": command}
        if cpu is not None:
            args["cpu-index"] = cpu
        reply = await self._execute("human-monitor-command", args)
        if not isinstance(reply, str):
            raise TransportError(f"human-monitor-command returned {type(reply).__name__}")
        return reply

    async def status(self) -> str:
        """The run state QEMU reports (running, paused, prelaunch, ...)."""
        reply = await self._execute("query-status")
        if not isinstance(reply, dict) or not isinstance(reply.get("status"), str):
            raise TransportError(f"unexpected query-status reply: {reply!r}")
        return str(reply["status"])

    async def is_running(self) -> bool:
        return await self.status() == "running"

    async def chardevs(self) -> dict[str, str]:
        """QEMU's character devices, label -> filename (``gdb`` when the VM has a gdbstub)."""
        reply = await self._execute("query-chardev")
        if not isinstance(reply, list):
            raise TransportError(f"unexpected query-chardev reply: {reply!r}")
        return {
            str(c["label"]): str(c.get("filename", ""))
            for c in reply
            if isinstance(c, dict) and "label" in c
        }

    def guard_pauses(self) -> None:
        """Start a guard (guard.py) that resumes the guest should this process die inside a
        pause: for a run that stops the guest, on a local socket (not over TCP)."""
        if self.guard is None and isinstance(self.address, str):
            self.guard = PauseGuard(self.address)

    def pausing(self) -> None:
        """A stop is on its way, by this connection or the gdbstub's: tell the guard."""
        if self.guard is not None:
            self.guard.pausing()

    def settled(self) -> None:
        """The guest is in the run state to leave it in: tell the guard."""
        if self.guard is not None:
            self.guard.settled()

    async def stop(self) -> None:
        """Stop the guest; GuestHeldError when it was stopped already (by something else: qmpprof
        stops only a guest it resumed), which is then left as it is."""
        stops = self._client.stops
        self.pausing()
        await self._execute("stop")
        if self._client.stops == stops:  # QEMU sends STOP, before its reply, on a change only
            self.settled()  # not our stop: nothing owed
            raise GuestHeldError(await self.status())

    async def cont(self) -> None:
        await self._execute("cont")
        self.settled()

    async def stop_and_registers(self, cpus: Sequence[int]) -> list[Registers | TransportError]:
        """One after the other: QEMU serves QMP commands in turn, and most of a command's cost
        is QEMU's (measured on 7.2: sending them together saved nothing)."""
        await self.stop()
        return await each_registers(self, cpus)

    async def cpus(self) -> list[int]:
        reply = await self._execute("query-cpus-fast")
        if not isinstance(reply, list):
            raise TransportError(f"unexpected query-cpus-fast reply: {reply!r}")
        return sorted(int(c["cpu-index"]) for c in reply if isinstance(c, dict))

    async def registers(self, cpu: int) -> Registers:
        text = await self.hmp("info registers", cpu)
        if "CPU#" not in text:
            # QEMU answers an unknown cpu-index with an error text, not a QMP error.
            raise TransportError(f"no registers for vCPU {cpu}: {text.strip()[:80]}")
        found = self.formats.from_monitor(text)
        if len(found) != 1:
            raise TransportError(f"expected one CPU in 'info registers' output, found {len(found)}")
        return found[0]

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        return {}  # `info registers` prints no system register a walk needs (TCR_EL1)

    async def read(self, cpu: int, addr: int, size: int) -> bytes:
        if size <= 0:
            # Nothing to read; and QEMU 7.2's memsave dies on a negative size (an assertion in
            # error_setv, seen on qemu-system-riscv64): never sent.
            return b""
        if self.memory == "memsave":
            try:
                async with self._dump_slots:
                    return await self._memsave(cpu, addr, size)
            except _MemsaveUnusable as err:
                if not self._auto:
                    raise TransportError(f"memsave cannot be used: {err}") from err
                self.memory = "hmp"
        text = await self.hmp(hmp.x_command(addr, size), cpu)
        return hmp.parse_x(text, addr, size)

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        """The reads issued together (QMP matches replies by id): one round trip's wait."""
        found = await asyncio.gather(
            *(self.read(cpu, a, n) for a, n in ranges), return_exceptions=True
        )
        for result in found:
            if isinstance(result, BaseException) and not isinstance(result, MemoryReadError):
                raise result
        return [r for r in found if isinstance(r, bytes | MemoryReadError)]

    async def read_physical(
        self, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        """Through the monitor's ``xp`` (physical reads are rare: no private file for them)."""
        found = await asyncio.gather(*(self._xp(a, n) for a, n in ranges), return_exceptions=True)
        for result in found:
            if isinstance(result, BaseException) and not isinstance(result, MemoryReadError):
                raise result
        return [r for r in found if isinstance(r, bytes | MemoryReadError)]

    async def _xp(self, addr: int, size: int) -> bytes:
        return hmp.parse_x(await self.hmp("xp" + hmp.x_command(addr, size)[1:]), addr, size)

    async def translate(self, cpu: int, addr: int) -> int | None:
        """The monitor's ``gva2gpa`` on ``cpu``: "gpa: 0x..." or "Unmapped"."""
        return hmp.parse_gva2gpa(await self.hmp(f"gva2gpa {addr:#x}", cpu))

    @property
    def control(self) -> QmpTransport:
        """QMP itself: memsave and the monitor need no stop."""
        return self

    async def _memsave(self, cpu: int, addr: int, size: int) -> bytes:
        path, fd = self._take_dump()
        try:
            # No truncation needed: memsave opens the file with "wb". A file QEMU never wrote
            # (it sees another filesystem) stays empty and fails the length check below.
            # QMP's val is a signed int64: kernel addresses go over as negative numbers.
            val = addr - (1 << 64) if addr >= 1 << 63 else addr
            args = {"val": val, "size": size, "filename": path, "cpu-index": cpu}
            try:
                await self._execute("memsave", args)
            except TransportError as err:
                if _INVALID_ADDR in str(err):
                    raise MemoryReadError(addr, size, "not mapped") from err
                raise _MemsaveUnusable(str(err)) from err
            data = os.pread(fd, size, 0)
        finally:
            self._free_dumps.append((path, fd))
        if len(data) != size:
            # QEMU wrote a file of that name somewhere else (another mount namespace).
            if self._dump_root is not None:
                self._dump_root = None  # try the ordinary temp directory once more
                self._discard_dumps()
                return await self._memsave(cpu, addr, size)
            raise _MemsaveUnusable(f"{path} holds {len(data)} bytes, not {size}")
        return data

    def _take_dump(self) -> tuple[str, int]:
        """A private file for one memsave: a free one, or a new one in our 0700 directory."""
        if self._free_dumps:
            return self._free_dumps.pop()
        if self._dump_dir is None:
            self._dump_dir = tempfile.mkdtemp(prefix="qmpprof-", dir=self._dump_root)  # 0700
        path = os.path.join(self._dump_dir, f"memsave-{len(self._all_dumps)}.bin")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as err:  # out of descriptors, say: the monitor's x needs none
            raise _MemsaveUnusable(f"cannot open {path}: {err.strerror or err}") from err
        self._all_dumps.append(fd)
        return path, fd

    def _discard_dumps(self) -> None:
        if self._dump_dir is not None:
            for fd in self._all_dumps:
                os.close(fd)
            self._all_dumps.clear()
            self._free_dumps.clear()
            shutil.rmtree(self._dump_dir, ignore_errors=True)
            self._dump_dir = None

    async def close(self) -> None:
        mark, self.mark = self.mark, None
        if mark is not None:
            # Bounded: a QEMU that stopped answering must not hold the end of the run. A mark
            # left behind names this pid, which the next run finds gone.
            with contextlib.suppress(TransportError, GuestGoneError, TimeoutError):
                async with asyncio.timeout(_MARK_WITHIN):
                    await vmmark.release(self, mark)
        self._discard_dumps()
        await _quiet_disconnect(self._client)
        if self.guard is not None:
            self.guard.close()


class _QuietClient(QMPClient):
    """qemu.qmp's message hooks format every message for a debug log line even when nobody
    logs (a JSON encoding of each 3 KiB register dump, per sample). The hooks are there for
    subclasses: these format only when debug logging is on.

    qemu.qmp also registers a default event listener that keeps every event (STOP and RESUME
    at every sample) in a queue and a history forever: ~0.9 KB per sample, measured. It cannot
    be removed; its filter turns every event away, and counts the STOP events on the way: QEMU
    sends one whenever the guest stops, before the reply to the command that stopped it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.stops = 0
        self.events.event_filter = self._count_stops

    def _count_stops(self, event: Message) -> bool:
        if event.get("event") == "STOP":
            self.stops += 1
        return False

    def _cb_outbound(self, msg: Message) -> Message:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("--> %s", msg)
        return msg

    def _cb_inbound(self, msg: Message) -> Message:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("<-- %s", msg)
        return msg


class _MemsaveUnusable(Exception):
    """memsave failed for a reason other than an unmapped address."""


async def register_formats(client: MonitorClient, where: str) -> RegisterFormats:
    """How this QEMU prints registers, by its target (``qemu-system-<target>``)."""
    try:
        reply = await client.execute("query-target")
    except _GONE as err:
        raise ConnectError(f"{where}: QEMU closed the QMP connection") from err
    except QMPError as err:
        raise ConnectError(f"{where}: query-target failed: {err}") from err
    target = str(reply.get("arch", "")) if isinstance(reply, dict) else ""
    formats = arch.formats(target)
    if formats is None:
        raise ConnectError(f"{where}: QEMU emulates {target or 'an unknown target'}:"
                           f" qmpprof reads {', '.join(arch.names())}")  # fmt: skip
    return formats


async def _negotiated(address: str | tuple[str, int], where: str, timeout: float) -> _QuietClient:
    """A client past the greeting and ``qmp_capabilities``; ConnectError when that is not
    possible within ``timeout``.

    QEMU runs a socket's QMP monitor in its I/O thread and emits events from the main thread:
    an event emitted as a client connects (another client's ``stop``, a gdbstub's continue)
    can reach it before the greeting or in place of the reply to ``qmp_capabilities``, while
    the monitor still counts as negotiated from its previous client (seen on QEMU 7.2 and 11.1:
    a connection in a few hundred made while another client stopped and resumed the guest;
    a test's connection right after gdb resumed it). qemu.qmp takes
    either for a peer that is no QMP server: such a connection is tried again, a few times."""
    deadline = asyncio.get_running_loop().time() + timeout
    for attempt in range(_SESSION_TRIES):
        client = _QuietClient("qmpprof")
        left = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(client.connect(address), max(left, 0.0))
        except TimeoutError as err:
            await _quiet_disconnect(client)
            raise ConnectError(
                f"{where}: no QMP greeting within {timeout:g} s"
                " (not a QMP server, or another client is connected)"
            ) from err
        except QmpConnectError as err:
            await _quiet_disconnect(client)
            if (
                isinstance(err.exc, GreetingError | NegotiationError)
                and attempt + 1 < _SESSION_TRIES
            ):
                continue
            raise ConnectError(f"{where}: {_connect_reason(err)}") from err
        except AssertionError as err:
            # qemu.qmp asserts it is running once negotiated; the peer may have closed the
            # connection just before (QEMU killed, the monitor's client cut).
            await _quiet_disconnect(client)
            raise ConnectError(f"{where}: closed the connection during the QMP greeting") from err
        return client
    raise AssertionError("unreachable: the last try returns or raises")


async def _quiet_disconnect(client: MonitorClient) -> None:
    # disconnect() re-raises the reader's EOFError when QEMU is already gone: nothing to do then.
    with contextlib.suppress(QMPError, OSError, EOFError):
        await client.disconnect()


def _connect_reason(err: QmpConnectError) -> str:
    cause = err.exc
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (QEMU not listening there?)"
    if isinstance(cause, FileNotFoundError):
        return "no such socket"
    if isinstance(cause, PermissionError):
        return "permission denied"
    if isinstance(cause, EOFError | ConnectionResetError):
        return "closed the connection during the QMP greeting (not a QMP server, or busy?)"
    if isinstance(cause, QMPError):
        return f"not a QMP server ({cause})"
    return f"cannot connect: {cause}"
