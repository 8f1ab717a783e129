"""One profiler per VM: a mark inside QEMU naming the qmpprof run that holds the VM.

Two profilers on one VM fight: each resumes the guest the other stopped, and a gdbstub whose
client did not see a resume loses the packets it was sent (see gdbchannel.py). So a run marks
the VM before it touches the guest, through whichever QMP socket it was given, and a second run
(any socket of the VM, any transport that speaks QMP) finds the mark and refuses, naming the
holder. The mark is a QOM object with a fixed id, added with ``object-add``: QEMU runs QMP
commands one at a time, and a second add of the same id fails ("attempt to add duplicate
property"), so of two runs starting together exactly one gets it. Its one readable string
property (``authz-simple``'s ``identity``) says who holds it: pid, process start time, host and
socket. The type is the lightest QEMU 7.2 and 11.1 both build in that has such a property
(measured on both: add, duplicate add, qom-get, object-del behave the same).

A mark whose holder is dead on this host (SIGKILL gives no chance to remove it) is recognised by
its pid and start time, and replaced. A holder on another host cannot be checked: refused.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Protocol

from qmpprof.errors import TransportError, VmBusyError

MARK_ID = "qmpprof-run"
_TYPE = "authz-simple"
_PROPERTY = "identity"
_DUPLICATE = "duplicate"  # object-add's refusal of an id in use
_NOT_FOUND = "not found"  # qom-get's and object-del's answer for an id not in use


class Monitor(Protocol):
    """What the mark needs of a QMP connection: one command, its reply or TransportError."""

    async def command(self, name: str, args: dict[str, object]) -> object: ...


@dataclass(frozen=True, slots=True)
class Holder:
    """The run holding a VM. ``started``: its process's start time (clock ticks after boot,
    /proc/PID/stat), which tells a reused pid apart."""

    pid: int
    started: int
    host: str
    socket: str

    @classmethod
    def this_run(cls, socket_name: str) -> Holder:
        return cls(os.getpid(), _start_time(os.getpid()) or 0, socket.gethostname(), socket_name)

    def text(self) -> str:
        # The socket goes last: a path may hold spaces.
        return f"pid={self.pid} started={self.started} host={self.host} socket={self.socket}"

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        head, _, where = text.partition(" socket=")
        fields = dict(field.partition("=")[::2] for field in head.split())
        try:
            return cls(int(fields["pid"]), int(fields["started"]), fields["host"], where)
        except (KeyError, ValueError):
            return None

    def gone(self) -> bool:
        """Whether this holder is a process of this host that no longer runs."""
        if self.host != socket.gethostname() or not os.path.exists("/proc/self/stat"):
            return False  # another host's, or no /proc to look in: nothing here can tell
        return _start_time(self.pid) != self.started

    def describe(self) -> str:
        here = "" if self.host == socket.gethostname() else f" on {self.host}"
        return f"qmpprof pid {self.pid}{here} (through {self.socket})"


@dataclass(frozen=True, slots=True)
class Mark:
    """This run's mark in a VM, to remove at the end; ``note``: a dead run's mark it replaced."""

    holder: Holder
    note: str | None = None


async def take(monitor: Monitor, where: str) -> Mark:
    """Mark the VM as this run's (``where``: the socket it was reached through). VmBusyError
    naming the holder when another run holds it; a dead run's mark is replaced."""
    me = Holder.this_run(where)
    note = None
    for _ in range(3):  # a mark that comes and goes meanwhile: look again
        if await _add(monitor, me):
            return Mark(me, note)
        found = await holder(monitor)
        if found is None:
            continue  # removed since (its run ended): add again
        if not found.gone():
            raise VmBusyError(f"{where}: {found.describe()} is profiling this VM:"
                              " one profiler per VM at a time")  # fmt: skip
        await _delete(monitor)
        note = f"removed the mark of {found.describe()}, which ended without removing it"
    raise VmBusyError(f"{where}: another qmpprof keeps marking this VM as its own")


async def holder(monitor: Monitor) -> Holder | None:
    """The run whose mark the VM holds (None: no mark). An unreadable mark is someone's all the
    same: it is named as pid 0, never taken as gone."""
    try:
        text = await monitor.command(
            "qom-get", {"path": f"/objects/{MARK_ID}", "property": _PROPERTY}
        )
    except TransportError as err:
        if _NOT_FOUND in str(err):
            return None
        raise
    found = Holder.parse(text) if isinstance(text, str) else None
    return found if found is not None else Holder(0, 0, "an unknown host", repr(text))


async def release(monitor: Monitor, mark: Mark) -> None:
    """Remove ``mark`` if the VM still holds it (not when another run replaced it)."""
    if await holder(monitor) == mark.holder:
        await _delete(monitor)


async def _add(monitor: Monitor, me: Holder) -> bool:
    args: dict[str, object] = {"qom-type": _TYPE, "id": MARK_ID, _PROPERTY: me.text()}
    try:
        await monitor.command("object-add", args)
    except TransportError as err:
        if _DUPLICATE in str(err):
            return False
        raise
    return True


async def _delete(monitor: Monitor) -> None:
    try:
        await monitor.command("object-del", {"id": MARK_ID})
    except TransportError as err:
        if _NOT_FOUND not in str(err):
            raise


def _start_time(pid: int) -> int | None:
    """``pid``'s start time (field 22 of /proc/PID/stat); None when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            text = stat.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count after it.
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None
