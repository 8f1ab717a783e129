"""How a gdbstub left by a dead qmpprof is told from any other (transport/stubdir.py): by QEMU's
filename for it, the directory's name, owner, mode and lock. Real directories and locks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qmpprof.transport.stubdir import StubDir, leftover, listening


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[StubDir]:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # TMPDIR is read again
    directory = StubDir.make()
    yield directory
    directory.remove()


def filename(directory: StubDir, connected: bool = False) -> str:
    # As QEMU 7.2 reports a listening Unix socket, without and with a client.
    return f"{'' if connected else 'disconnected:'}unix:{directory.socket},server=on"


def test_a_new_directory_is_private_locked_and_named_as_ours(made: StubDir) -> None:
    assert Path(made.path).name.startswith("qmpprof-gdb-")
    assert os.stat(made.path).st_mode & 0o777 == 0o700
    assert leftover(filename(made)) is None  # locked: a live run's


def test_a_dead_run_s_directory_is_a_leftover(made: StubDir) -> None:
    made.release()  # as the kernel does when the process dies
    found = leftover(filename(made))
    assert found is not None and found.path == made.path
    assert leftover(filename(made)) is None  # now ours: locked again
    found.remove()
    assert not os.path.exists(made.path)


def test_a_lock_held_by_another_live_process_keeps_it_alive(made: StubDir) -> None:
    made.release()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY);"
         " fcntl.flock(fd, fcntl.LOCK_EX); print(flush=True); sys.stdin.read()", made.path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline() == "\n"
    try:
        assert leftover(filename(made)) is None
    finally:
        holder.communicate("")
    found = leftover(filename(made))  # the holder died: its lock went with it
    assert found is not None
    found.release()


@pytest.mark.parametrize(
    "text",
    [
        "unix:{socket},server=on",  # a client is connected
        "disconnected:unix:{socket}x,server=on",  # another socket name
        "disconnected:tcp:127.0.0.1:1234,server=on",
        "gdb",  # QEMU's chardev for gdb's monitor command, kept for QEMU's life
    ],
)
def test_other_filenames_are_not_leftovers(made: StubDir, text: str) -> None:
    made.release()
    assert leftover(text.format(socket=made.socket)) is None


def test_a_directory_not_0700_or_a_link_is_not_ours(made: StubDir, tmp_path: Path) -> None:
    made.release()
    os.chmod(made.path, 0o755)
    assert leftover(filename(made)) is None
    os.chmod(made.path, 0o700)
    link = tmp_path / "qmpprof-gdb-link0000"
    link.symlink_to(made.path)
    assert leftover(f"disconnected:unix:{link}/gdb.sock,server=on") is None
    assert leftover(filename(made)) is not None


def test_listening_sees_a_unix_listener_only_while_it_listens(made: StubDir) -> None:
    assert not listening(made.socket)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(made.socket)
        assert not listening(made.socket)  # bound, not listening
        server.listen(1)
        assert listening(made.socket)
    finally:
        server.close()
    assert not listening(made.socket)  # the file stays; nobody listens


def test_a_deep_temporary_directory_falls_back_to_tmp(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)
    directory = StubDir.make()
    try:
        assert Path(directory.path).parent == Path("/tmp")
        assert len(directory.socket) <= 107
    finally:
        directory.remove()
    assert list(deep.iterdir()) == []
