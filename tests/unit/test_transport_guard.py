"""The pause guard (transport/guard.py) as a run starts it: a real process of its own, on the
standard library alone (-I -S: an import of qmpprof there ends it with status 1), facing a
scripted QMP server on a Unix socket. qmpprof's death is played by closing the pipe's write end,
as the kernel does when a process dies: the guard resumes a guest stopped by a pause it died in,
and takes away the gdbstub and mark a dead run left, and nothing else."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from qmpprof.transport.guard import PauseGuard

GREETING = {"QMP": {"version": {}, "capabilities": []}}
STATUS = {"status": "debug", "running": False}  # as the gdbstub's stop leaves a guest
NO_MARK = {"error": {"class": "DeviceNotFound", "desc": "Device 'qmpprof-run' not found"}}


class FakeQmp:
    """A QMP server that serves one client and notes the commands it was sent, answering each
    from ``replies`` (a return, or ``{"error": ...}``): by default a stopped guest, no
    chardevs, no mark."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.commands: list[str] = []
        self.replies: dict[str, object] = {
            "query-status": STATUS,
            "query-chardev": [],
            "qom-get": NO_MARK,
        }
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        client, _ = self.server.accept()
        with client, client.makefile("rwb") as lines:
            lines.write(json.dumps(GREETING).encode() + b"\n")
            lines.flush()
            while line := lines.readline():
                message = json.loads(line)
                command = message["execute"]
                self.commands.append(command)
                if command == "human-monitor-command":
                    self.commands[-1] += " " + message["arguments"]["command-line"]
                reply = self.replies.get(command, {})
                error = isinstance(reply, dict) and "error" in reply
                lines.write(json.dumps(reply if error else {"return": reply}).encode() + b"\n")
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


def test_a_run_closed_in_order_lets_the_guard_go_without_a_word_to_qemu(
    qmp: FakeQmp, tmp_path: Path
) -> None:
    guard = PauseGuard(str(tmp_path / "qmp.sock"))
    guard.pausing()
    guard.settled()
    guard.close()
    assert guard._process.returncode == 0
    assert qmp.commands == []


def test_a_death_inside_a_pause_resumes_the_guest(
    qmp: FakeQmp, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    guard = PauseGuard(str(tmp_path / "qmp.sock"))
    guard.pausing()
    assert died(guard) == 0
    qmp.thread.join(timeout=30)
    assert qmp.commands == ["qmp_capabilities", "query-status", "cont", "query-chardev", "qom-get"]
    assert "qmpprof ended inside a pause; the guest (debug) runs again" in capfd.readouterr().err


def stub_folder(tmp_path: Path) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="qmpprof-gdb-", dir=tmp_path))
    (folder / "gdb.sock").touch()
    return folder


def test_a_death_outside_a_pause_takes_away_its_stub_and_mark(
    qmp: FakeQmp, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    folder = stub_folder(tmp_path)
    qmp.replies["query-chardev"] = [
        {"label": "monitor", "filename": "unix:/run/qmp.sock,server=on"},
        {"label": "gdb", "filename": f"disconnected:unix:{folder}/gdb.sock,server=on"},
    ]
    qmp.replies["qom-get"] = f"pid={os.getpid()} started=1 host=h socket=/run/qmp.sock"
    guard = PauseGuard(str(tmp_path / "qmp.sock"))  # its parent: this process, the mark's pid
    guard.pausing()
    guard.settled()
    assert died(guard) == 0
    qmp.thread.join(timeout=30)
    assert qmp.commands == [
        "qmp_capabilities",
        "query-chardev",
        "human-monitor-command gdbserver none",
        "qom-get",
        "object-del",
    ]
    assert not folder.exists()
    assert "runs again" not in capfd.readouterr().err  # the guest was not stopped by it


def test_what_is_not_the_dead_runs_stays(qmp: FakeQmp, tmp_path: Path) -> None:
    held, user = stub_folder(tmp_path), tmp_path / "mine"
    user.mkdir()
    qmp.replies["query-chardev"] = [
        {"label": "gdb", "filename": f"disconnected:unix:{held}/gdb.sock,server=on"},
    ]
    qmp.replies["qom-get"] = "pid=1 started=1 host=h socket=/run/qmp.sock"  # another run's
    lock = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a live run holds its stub
    try:
        guard = PauseGuard(str(tmp_path / "qmp.sock"))
        guard.settled()
        assert died(guard) == 0
        qmp.thread.join(timeout=30)
    finally:
        os.close(lock)
    assert qmp.commands == ["qmp_capabilities", "query-chardev", "qom-get"]
    assert held.exists()


def test_a_stub_in_a_folder_named_as_ours_but_not_0700_stays(qmp: FakeQmp, tmp_path: Path) -> None:
    """stubdir.py's rule: a folder of qmpprof's is this user's, mode 0700 (a user's stub in a
    lookalike folder is never touched)."""
    lookalike = stub_folder(tmp_path)
    lookalike.chmod(0o755)
    qmp.replies["query-chardev"] = [
        {"label": "gdb", "filename": f"disconnected:unix:{lookalike}/gdb.sock,server=on"},
    ]
    guard = PauseGuard(str(tmp_path / "qmp.sock"))
    guard.settled()
    assert died(guard) == 0
    qmp.thread.join(timeout=30)
    assert qmp.commands == ["qmp_capabilities", "query-chardev", "qom-get"]
    assert lookalike.exists()
