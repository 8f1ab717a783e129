"""The pause guard (transport/guard.py) as a run starts it: a real process of its own, on the
standard library alone (-I -S: an import of qmpprof there ends it with status 1), facing a
scripted QMP server on a Unix socket. qmpprof's death is played
by closing the pipe's write end, as the kernel does when a process dies."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from qmpprof.transport.guard import PauseGuard

GREETING = {"QMP": {"version": {}, "capabilities": []}}
STATUS = {"status": "debug", "running": False}  # as the gdbstub's stop leaves a guest


class FakeQmp:
    """A QMP server that serves one client and notes the commands it was sent."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.commands: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        client, _ = self.server.accept()
        with client, client.makefile("rwb") as lines:
            lines.write(json.dumps(GREETING).encode() + b"\n")
            lines.flush()
            while line := lines.readline():
                command = json.loads(line)["execute"]
                self.commands.append(command)
                reply = STATUS if command == "query-status" else {}
                lines.write(json.dumps({"return": reply}).encode() + b"\n")
                lines.flush()


@pytest.fixture
def qmp(tmp_path: Path) -> Iterator[FakeQmp]:
    server = FakeQmp(tmp_path / "qmp.sock")
    yield server
    server.server.close()


def died(guard: PauseGuard) -> int:
    """qmpprof's end without ``close``: the pipe closes; the guard's exit status."""
    os.close(guard._pipe)
    return guard._process.wait(timeout=30)


def test_an_ordinary_end_lets_the_guard_go_without_a_word_to_qemu(
    qmp: FakeQmp, tmp_path: Path
) -> None:
    guard = PauseGuard(str(tmp_path / "qmp.sock"))
    guard.pausing()
    guard.settled()
    assert died(guard) == 0
    assert qmp.commands == []


def test_a_death_inside_a_pause_resumes_the_guest(
    qmp: FakeQmp, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    guard = PauseGuard(str(tmp_path / "qmp.sock"))
    guard.pausing()
    assert died(guard) == 0
    qmp.thread.join(timeout=30)
    assert qmp.commands == ["qmp_capabilities", "query-status", "cont"]
    assert "qmpprof ended inside a pause; the guest (debug) runs again" in capfd.readouterr().err
