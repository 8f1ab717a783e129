"""QEMU's events seen over a QMP socket of the test's own: each STOP is a pause of the guest
(a tick of qmpprof's, once it samples), so a test waits for samples taken by counting them
rather than by sleeping a while."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any


class QmpEvents:
    """A QMP connection that only listens: QEMU sends each event (STOP, RESUME, ...) to every
    negotiated monitor, in order, stamped with the host's wall clock. Nothing is sent on it
    after the greeting, so all it receives then is events."""

    def __init__(self, path: Path | str, timeout: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock.connect(str(path))
        self._pending = b""
        # QEMU 7.2 can hand a new client events queued before its greeting: passed over, as
        # they may be older than this connection.
        while "QMP" not in self.message():
            pass
        self._sock.sendall(b'{"execute": "qmp_capabilities"}')
        while "return" not in self.message():
            pass

    def message(self) -> dict[str, Any]:
        """The next message, waited for."""
        while b"\n" not in self._pending:
            more = self._sock.recv(65536)
            assert more, "QEMU closed the events connection"
            self._pending += more
        line, _, self._pending = self._pending.partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        return message

    def fileno(self) -> int:
        return self._sock.fileno()

    def received(self) -> Iterator[tuple[str, float]]:
        """The events received by now (call when the socket is readable): name, host time."""
        self._pending += self._sock.recv(65536)
        while b"\n" in self._pending:
            event = self.message()
            stamp = event["timestamp"]
            yield event["event"], stamp["seconds"] + stamp["microseconds"] / 1e6

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> QmpEvents:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def wait_stops(path: Path | str, count: int, timeout: float) -> None:
    """Until QEMU has told the QMP socket at ``path`` of ``count`` stops from now on (STOP
    events), within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with QmpEvents(path, timeout) as events:
        stops = 0
        while stops < count:
            assert time.monotonic() < deadline, f"{stops} stops of {count} seen"
            stops += events.message().get("event") == "STOP"
