"""A guest resumed even when qmpprof dies inside one of its pauses.

SIGKILL (``kill -9``, the OOM killer) ends a process with no chance to undo anything: killed
between a stop and its cont, qmpprof would leave the guest stopped. So a run that stops the
guest over a local QMP socket starts a guard (``PauseGuard``): a small process of its own
session (a signal to qmpprof's process group does not reach it) that holds the read end of a
pipe whose write end only qmpprof holds, and a byte of memory it shares with qmpprof, set during
each pause. The guard sleeps on the pipe; when the pipe closes (qmpprof ended, however it
ended) with the byte set, qmpprof died inside a pause: the guard connects to the VM's QMP
socket (free once qmpprof's connection has closed), and resumes the guest if it stands
stopped, saying so on qmpprof's standard error. A run that ended without closing in order (in a
pause or not: a second bit of the byte) also left its private gdbstub and its mark in QEMU: the
guard removes them as the next run would (stubdir.py's leftover, vmmark.py's mark naming
qmpprof's pid). An ordinary end clears the byte and the guard exits at once. The guard speaks
QMP itself, with the standard library only: it starts in tens of milliseconds and needs no
memory to speak of.

A libvirt domain has no QMP socket to reach: its guard (``PauseGuard.for_domain``) asks libvirt
instead, through the monitor passthrough qmpprof's own commands took (libvirt's Python binding,
imported by the guard only then: it starts with the site packages, unlike a socket's).

Not covered: a guard killed with qmpprof (``kill -9`` of both, a container torn down), and QMP
over TCP (no guard is started).
"""

from __future__ import annotations

import fcntl
import io
import json
import mmap
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable

CONNECT_FOR = 10.0  # seconds the guard tries QMP for, once qmpprof is gone
_PAUSED = 1  # the flag's bits: qmpprof owes the guest a cont,
_OPEN = 2  # and its run is open (not closed in order)
MARK_ID = "qmpprof-run"  # vmmark.py's (this script imports nothing of qmpprof's)
_STOPPED = ("paused", "debug")  # run states of a guest stopped by qmpprof (QMP or gdbstub)
# The guard's process runs this file as a script, not ``qmpprof.transport.guard``: importing
# that name runs the packages' __init__ modules (every transport, qemu.qmp, asyncio), 0.11 s of
# CPU where the script needs 0.02 s (measured on a loaded 2-core host), and a run's ``close``
# waits for the guard's exit. -I -S: the standard library alone, nothing from the environment.
_SCRIPT = os.path.abspath(__file__)


class PauseGuard:
    """The guard of one VM, from the start of a run to its end: the VM at a local QMP socket,
    or a libvirt domain (``for_domain``)."""

    def __init__(self, qmp_socket: str, *, domain: tuple[str, str] | None = None) -> None:
        flag = os.memfd_create("qmpprof-pause", os.MFD_CLOEXEC)
        os.ftruncate(flag, 1)
        self._flag = mmap.mmap(flag, 1)
        self._flag[0] = _OPEN
        read, self._pipe = os.pipe2(os.O_CLOEXEC)
        # -S (no site packages) but for a domain, whose guard imports libvirt's binding
        python = [sys.executable, "-I"] if domain else [sys.executable, "-I", "-S"]
        target = ["--domain", *domain] if domain else [qmp_socket]
        self._process = subprocess.Popen(
            [*python, _SCRIPT, str(read), str(flag), *target],
            pass_fds=(read, flag), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        os.close(read)
        os.close(flag)

    @classmethod
    def for_domain(cls, uri: str | None, name: str) -> PauseGuard:
        """The guard of libvirt's domain ``name`` at ``uri`` (None: libvirt's default)."""
        return cls("", domain=(uri or "", name))

    def pausing(self) -> None:
        """qmpprof is about to stop the guest: from now it owes the guest a cont."""
        self._flag[0] = _OPEN | _PAUSED

    def settled(self) -> None:
        """The guest is in the run state qmpprof must leave it in (it runs again, or it was
        put back in the stop a user had it in)."""
        self._flag[0] = _OPEN

    def close(self) -> None:
        """The run ended in order (what it could resume, it resumed): the guard exits."""
        if self._pipe < 0:
            return
        self._flag[0] = 0
        os.close(self._pipe)
        self._pipe = -1
        try:
            self._process.wait(timeout=CONNECT_FOR + 5)
        except subprocess.TimeoutExpired:
            self._process.kill()


def watch(pipe: int, flag_fd: int, target: list[str]) -> int:
    """The guard process: wait for qmpprof's end; if it ended without closing its run, resume
    the guest when it died in a pause and take away what it left in QEMU (``_clean``).
    ``target``: the QMP socket, or ``--domain URI NAME``."""
    flag = mmap.mmap(flag_fd, 1)
    owner = os.getppid()  # qmpprof: the mark names it
    while os.read(pipe, 1):
        pass  # nothing is ever written: the read returns at the end, empty
    if not flag[0] & _OPEN:
        return 0
    deadline = time.monotonic() + CONNECT_FOR
    while True:
        try:
            if target[0] == "--domain":
                state = _domain(target[1], target[2], flag[0] & _PAUSED, owner)
            else:
                state = _socket(target[0], flag[0] & _PAUSED, owner)
        except OSError as err:
            if time.monotonic() > deadline:
                print(f"qmpprof: guard: could not resume the guest: {err}", file=sys.stderr)
                return 1
            time.sleep(0.05)
            continue
        if state is not None:
            print(f"qmpprof: guard: qmpprof ended inside a pause; the guest ({state}) runs again",
                  file=sys.stderr)  # fmt: skip
        return 0


Command = Callable[[str, dict[str, object]], object]


def _socket(qmp_socket: str, paused: int, owner: int) -> str | None:
    """``_clean`` over QMP at ``qmp_socket``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        sock.connect(qmp_socket)
        lines = sock.makefile("rwb")
        _reply(lines)  # the greeting, or an event before it (then _command passes it over)

        def command(name: str, args: dict[str, object]) -> object:
            return _command(lines, name, args)

        command("qmp_capabilities", {})
        return _clean(command, paused, owner)


def _domain(uri: str, name: str, paused: int, owner: int) -> str | None:
    """``_clean`` through libvirt's monitor passthrough to the domain ``name`` (its connection
    is free once qmpprof's has closed; libvirt takes the commands in turn)."""
    import libvirt
    import libvirt_qemu

    libvirt.registerErrorHandler(lambda context, error: None, None)
    try:
        connection = libvirt.open(uri or None)
        try:
            domain = connection.lookupByName(name)

            def command(cmd: str, args: dict[str, object]) -> object:
                text = json.dumps({"execute": cmd, "arguments": args})
                return _answer(json.loads(libvirt_qemu.qemuMonitorCommand(domain, text, 0)), cmd)

            return _clean(command, paused, owner)
        finally:
            connection.close()
    except libvirt.libvirtError as err:
        raise OSError(err.get_error_message()) from err


def _clean(command: Command, paused: int, owner: int) -> str | None:
    """What a qmpprof ended outright owes the VM: a cont if it died in a pause and the guest
    stands stopped (the state it was in is returned, else None); then its private gdbstub
    removed (stubdir.py's leftover: a chardev ``gdb`` listening, unconnected, on a socket in
    a ``qmpprof-gdb-`` directory nobody holds the lock of) and its mark (vmmark.py's, naming
    ``owner``), as the next run would remove them."""
    state = None
    if paused:
        status = _as_dict(command("query-status", {})).get("status")
        if status in _STOPPED:
            command("cont", {})
            state = str(status)
    chardevs = command("query-chardev", {})
    for chardev in chardevs if isinstance(chardevs, list) else []:
        if isinstance(chardev, dict) and chardev.get("label") == "gdb":
            folder = _leftover_stub(str(chardev.get("filename", "")))
            if folder is not None:
                command("human-monitor-command", {"command-line": "gdbserver none"})
                shutil.rmtree(folder, ignore_errors=True)
    try:
        holder = command("qom-get", {"path": f"/objects/{MARK_ID}", "property": "identity"})
    except OSError as err:
        if "not found" in str(err):
            return state  # no mark: it was removed, or never taken
        raise
    if isinstance(holder, str) and holder.startswith(f"pid={owner} "):
        command("object-del", {"id": MARK_ID})
    return state


def _leftover_stub(filename: str) -> str | None:
    """The folder of qmpprof's gdbstub whose chardev has ``filename``, when it is a leftover by
    stubdir.py's rules (this script imports none of qmpprof): a ``qmpprof-gdb-`` directory, not
    a link, this user's, mode 0700, whose lock nobody holds."""
    found = re.fullmatch(r"disconnected:unix:(/[^,]*/qmpprof-gdb-[A-Za-z0-9_]+)/gdb\.sock(,.*)?",
                         filename)  # fmt: skip
    if found is None:
        return None
    folder = found.group(1)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != 0o700:
            return None  # a user's stub in a folder named as ours: never touched
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a run holds it
    except OSError:
        return None
    finally:
        os.close(fd)
    return folder


def _command(lines: io.BufferedRWPair, name: str, args: dict[str, object]) -> object:
    message: dict[str, object] = {"execute": name}
    if args:
        message["arguments"] = args
    lines.write(json.dumps(message).encode() + b"\n")
    lines.flush()
    while True:
        reply = _reply(lines)
        if "event" in reply or "QMP" in reply:  # QEMU may queue events before the greeting
            continue
        return _answer(reply, name)


def _answer(reply: object, name: str) -> object:
    """A QMP reply's return; OSError for its error."""
    if not isinstance(reply, dict):
        return None
    if "error" in reply:
        raise OSError(f"QMP {name}: {reply['error']}")
    return reply.get("return", {})


def _as_dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _reply(lines: io.BufferedRWPair) -> dict[str, object]:
    line = lines.readline()
    if not line:
        raise OSError("QMP closed the connection")
    reply = json.loads(line)
    return reply if isinstance(reply, dict) else {}


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
