"""QEMU's events seen over a QMP socket of the test's own: each STOP is a pause of the guest
(a tick of qmpprof's, once it samples), so a test waits for samples taken by counting them
rather than by sleeping a while."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path


def wait_stops(path: Path | str, count: int, timeout: float) -> None:
    """Until QEMU has told the QMP socket at ``path`` of ``count`` stops from now on (STOP
    events), within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        with sock.makefile("rb") as replies:
            stops, greeted = 0, False
            while stops < count:
                line = replies.readline()
                assert line and time.monotonic() < deadline, f"{stops} stops of {count} seen"
                message = json.loads(line)
                # QEMU 7.2 can hand a new client events queued before its greeting: passed over,
                # as they may be older than this connection.
                stops += greeted and message.get("event") == "STOP"
                if "QMP" in message and not greeted:
                    sock.sendall(b'{"execute": "qmp_capabilities"}')
                    greeted = True
