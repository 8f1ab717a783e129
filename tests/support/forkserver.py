"""qmpprof's command line run many times without paying Python's start each time: a server
process imports qmpprof once (with the environment and folder the runs get), and each run is a
fork of it that calls ``qmpprof.cli.main`` on the run's arguments, as ``python -m qmpprof``
does, its stdin and stdout /dev/null and its stderr a pipe to the caller. What a run does from
its first line of ``main`` on is the command's own; only the interpreter's start and the
imports are shared. (test_faults_e2e starts 200 runs: their imports were a third to half of
its time.)

``Run`` answers as much of ``subprocess.Popen`` as such a test uses: ``pid``, ``stderr`` (read
by its file descriptor), ``send_signal``, ``communicate`` and ``returncode``, the
exit status the server reads when it reaps the run."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

# The server: argv[1] its socket, argv[2:] the modules to import before the first run.
SERVER = r"""
import atexit, importlib, json, os, socket, sys, traceback
path, preload = sys.argv[1], sys.argv[2:]
for name in preload:
    importlib.import_module(name)
import qmpprof.cli
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(1)
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            listener.close()
            conn.close()
            for fd, target in zip(fds, (0, 1, 2)):
                os.dup2(fd, target)
                os.close(fd)
            sys.argv = ["qmpprof", *json.loads(message)["argv"]]
            code = qmpprof.cli.main()
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    conn.close()
"""

READY_TIMEOUT = 120.0  # the server's imports, on a loaded host: a guard, not a speed check


class Run:
    """One run of qmpprof, forked by the server."""

    def __init__(self, conn: socket.socket, stderr: int) -> None:
        self._conn = conn
        self._reply = b""
        self.stderr = os.fdopen(stderr, "rb", buffering=0)
        self.returncode: int | None = None
        line = self._line(READY_TIMEOUT)
        if line is None:
            raise RuntimeError("the fork server did not start the run")
        self.pid = int(line)

    def _line(self, timeout: float | None) -> str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._reply:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], wait)[0]:
                return None
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError("the fork server went away")
            self._reply += chunk
        line, self._reply = self._reply.split(b"\n", 1)
        return line.decode()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is not None:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        """The rest of its stderr, once it ended (TimeoutExpired after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rest = b""
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.stderr], [], [], wait)[0]:
                raise subprocess.TimeoutExpired("qmpprof", timeout or 0.0)
            chunk = self.stderr.read(65536)
            if not chunk:
                break
            rest += chunk
        self.stderr.close()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self.wait(left) is None:
            raise subprocess.TimeoutExpired("qmpprof", timeout or 0.0)
        return None, rest.decode()


class ForkServer:
    """The server, started with ``env`` in ``cwd``; ``preload``: the modules a run imports."""

    def __init__(self, env: dict[str, str], cwd: Path, preload: tuple[str, ...] = ()) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="qfs-", dir="/tmp"))
        self.path = self._folder / "server.sock"
        self._server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(self.path), *preload],
            env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self._server.stdout is not None
        ready = select.select([self._server.stdout], [], [], READY_TIMEOUT)[0]
        if not ready or self._server.stdout.readline() != b"ready\n":
            self.close()
            raise RuntimeError(f"the fork server did not start (exit {self._server.poll()})")

    def start(self, argv: list[str]) -> Run:
        """qmpprof with these arguments (what follows ``python -m qmpprof``)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self.path))
        read_end, write_end = os.pipe()
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            message = json.dumps({"argv": argv}).encode()
            socket.send_fds(conn, [message], [devnull, devnull, write_end])
        finally:
            os.close(write_end)
            os.close(devnull)
        return Run(conn, read_end)

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.send_signal(signal.SIGKILL)
            self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        self.path.unlink(missing_ok=True)
        self._folder.rmdir()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
