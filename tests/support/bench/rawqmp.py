"""A minimal blocking QMP client on a plain socket and json: the floor any QMP sampler pays.

No qemu.qmp, no asyncio: one ``sendall`` and one line read per command. The benchmark measures
sampling through it as the cost of QMP itself; tests use it as an independent witness of the
guest's registers, memory and run state.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Any

from qmpprof.errors import ConnectError, GuestGoneError, TransportError


class RawQmp:
    """One QMP connection on a Unix socket, capabilities negotiated."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as err:
            self._sock.close()
            raise ConnectError(f"cannot connect to QMP at {path}: {err.strerror}") from err
        self._file = self._sock.makefile("rb")
        try:
            greeting = self._message()
            if "QMP" not in greeting:
                raise ConnectError(f"{path} is not a QMP server")
            self.execute("qmp_capabilities")
        except BaseException:  # no greeting in time (a client holds QEMU's), or none at all
            self._file.close()
            self._sock.close()
            raise
        # tmpfs when there is one, as qmpprof's own transport does: the best QMP can do.
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        fd, self._dump = tempfile.mkstemp(prefix="qmpprof-bench-", suffix=".bin", dir=shm)
        os.close(fd)

    def _message(self) -> dict[str, Any]:
        line = self._file.readline()
        if not line:
            raise GuestGoneError("QEMU closed the QMP connection")
        message: dict[str, Any] = json.loads(line)
        return message

    def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        """Run one command and return its ``return`` value; events in between are dropped."""
        request: dict[str, Any] = {"execute": command}
        if arguments:
            request["arguments"] = arguments
        self._sock.sendall(json.dumps(request).encode())
        while True:
            reply = self._message()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise TransportError(f"QMP {command}: {reply['error'].get('desc', reply)}")

    def hmp(self, command_line: str, cpu: int | None = None) -> str:
        arguments: dict[str, Any] = {"command-line": command_line}
        if cpu is not None:
            arguments["cpu-index"] = cpu
        text: str = self.execute("human-monitor-command", arguments)
        return text

    def running(self) -> bool:
        return bool(self.execute("query-status")["running"])

    def memsave(self, addr: int, size: int, cpu: int = 0) -> bytes:
        """``size`` bytes of guest-virtual memory at ``addr`` as ``cpu`` sees it."""
        # memsave's val is a signed int64: kernel addresses go negative.
        val = addr - (1 << 64) if addr >= 1 << 63 else addr
        self.execute(
            "memsave", {"val": val, "size": size, "filename": self._dump, "cpu-index": cpu}
        )
        with open(self._dump, "rb") as dump:
            return dump.read()

    def close(self) -> None:
        """Idempotent: the benchmark hands the one QMP socket back and forth."""
        self._file.close()
        self._sock.close()
        if os.path.exists(self._dump):
            os.unlink(self._dump)

    def __enter__(self) -> RawQmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
