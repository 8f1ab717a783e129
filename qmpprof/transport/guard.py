"""A guest resumed even when qmpprof dies inside one of its pauses.

SIGKILL (``kill -9``, the OOM killer) ends a process with no chance to undo anything: killed
between a stop and its cont, qmpprof would leave the guest stopped. So a run that stops the
guest over a local QMP socket starts a guard (``PauseGuard``): a small process of its own
session (a signal to qmpprof's process group does not reach it) that holds the read end of a
pipe whose write end only qmpprof holds, and a byte of memory it shares with qmpprof, set during
each pause. The guard sleeps on the pipe; when the pipe closes (qmpprof ended, however it
ended) with the byte set, qmpprof died inside a pause: the guard connects to the VM's QMP
socket (free once qmpprof's connection has closed), and resumes the guest if it stands
stopped, saying so on qmpprof's standard error. An ordinary end leaves the byte clear and the
guard exits at once. The guard speaks QMP itself, with the standard library only: it starts in
tens of milliseconds and needs no memory to speak of.

Not covered: a guard killed with qmpprof (``kill -9`` of both, a container torn down), and QMP
over TCP (no guard is started).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import socket
import subprocess
import sys
import time

CONNECT_FOR = 10.0  # seconds the guard tries QMP for, once qmpprof is gone
_STOPPED = ("paused", "debug")  # run states of a guest stopped by qmpprof (QMP or gdbstub)
# The guard's process runs this file as a script, not ``qmpprof.transport.guard``: importing
# that name runs the packages' __init__ modules (every transport, qemu.qmp, asyncio), 0.11 s of
# CPU where the script needs 0.02 s (measured on a loaded 2-core host), and a run's ``close``
# waits for the guard's exit. -I -S: the standard library alone, nothing from the environment.
_SCRIPT = os.path.abspath(__file__)


class PauseGuard:
    """The guard of one VM, from the start of a run to its end."""

    def __init__(self, qmp_socket: str) -> None:
        flag = os.memfd_create("qmpprof-pause", os.MFD_CLOEXEC)
        os.ftruncate(flag, 1)
        self._flag = mmap.mmap(flag, 1)
        read, self._pipe = os.pipe2(os.O_CLOEXEC)
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", _SCRIPT, qmp_socket, str(read), str(flag)],
            pass_fds=(read, flag), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        os.close(read)
        os.close(flag)

    def pausing(self) -> None:
        """qmpprof is about to stop the guest: from now it owes the guest a cont."""
        self._flag[0] = 1

    def settled(self) -> None:
        """The guest is in the run state qmpprof must leave it in (it runs again, or it was
        put back in the stop a user had it in)."""
        self._flag[0] = 0

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


def watch(qmp_socket: str, pipe: int, flag_fd: int) -> int:
    """The guard process: wait for qmpprof's end; resume the guest if it died in a pause."""
    flag = mmap.mmap(flag_fd, 1)
    while os.read(pipe, 1):
        pass  # nothing is ever written: the read returns at the end, empty
    if not flag[0]:
        return 0
    deadline = time.monotonic() + CONNECT_FOR
    while True:
        try:
            state = _resume(qmp_socket)
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


def _resume(qmp_socket: str) -> str | None:
    """Over QMP at ``qmp_socket``: cont if the guest stands stopped; the state it was in, or None
    when it was not stopped."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        sock.connect(qmp_socket)
        lines = sock.makefile("rwb")
        _reply(lines)  # the greeting, or an event before it (then _command passes it over)
        _command(lines, "qmp_capabilities")
        status = _command(lines, "query-status").get("status")
        if status not in _STOPPED:
            return None
        _command(lines, "cont")
        return str(status)


def _command(lines: io.BufferedRWPair, name: str) -> dict[str, object]:
    lines.write(json.dumps({"execute": name}).encode() + b"\n")
    lines.flush()
    while True:
        reply = _reply(lines)
        if "event" in reply or "QMP" in reply:  # QEMU may queue events before the greeting
            continue
        if "error" in reply:
            raise OSError(f"QMP {name}: {reply['error']}")
        answer = reply.get("return", {})
        return answer if isinstance(answer, dict) else {}


def _reply(lines: io.BufferedRWPair) -> dict[str, object]:
    line = lines.readline()
    if not line:
        raise OSError("QMP closed the connection")
    reply = json.loads(line)
    return reply if isinstance(reply, dict) else {}


if __name__ == "__main__":
    sys.exit(watch(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
