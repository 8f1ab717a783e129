"""The default transport end to end: ``qmpprof --qmp-socket S`` takes a private gdbstub it opens
over QMP, and every way a run can end leaves no gdbstub, no private directory and the guest's
run state as it was. A VM that already has a gdbstub is sampled over QMP and its stub is left
alone. The guest has a witness QMP socket (tests/witnessvm.py) to watch all this from outside.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from guestvm import free_tcp_port
from qemus import every_qemu
from witnessvm import Vm, vm

from qmpprof.output import folded
from qmpprof.transport.gdb import GdbTransport

pytestmark = [pytest.mark.qemu, every_qemu]

FAST = "qmpprof: samples travel through a private gdbstub opened over QMP"


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    """qmpprof's TMPDIR: where its private gdbstub directory goes (short: a socket path)."""
    path = Path(tempfile.mkdtemp(prefix="fp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def spawn(machine: Vm, tmpdir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "qmpprof", "--qmp-socket", machine.socket, "-v", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )


def wait_sampling(proc: subprocess.Popen[str]) -> list[str]:
    """The stderr lines up to qmpprof's 'sampling' line (the run has started)."""
    assert proc.stderr is not None
    lines = []
    while not lines or not lines[-1].startswith("qmpprof: sampling "):
        line = proc.stderr.readline()
        assert line, "".join(lines) + proc.communicate()[1]
        lines.append(line)
    return lines


def machine_paused(machine: Vm, pauses: int, timeout: float = 120.0) -> None:
    """Until the witness has seen the run pause the guest ``pauses`` times (stopped, then
    running again): the run is sampling, not only started."""
    deadline = time.monotonic() + timeout
    stopped = False
    while pauses:
        assert time.monotonic() < deadline, f"{pauses} more pauses not seen in {timeout} s"
        now = machine.witness.execute("query-status")["status"] in ("paused", "debug")
        pauses -= stopped and not now
        stopped = now


def assert_left_clean(machine: Vm, tmpdir: Path, status: str = "running") -> None:
    assert "gdb" not in machine.chardevs()
    assert list(tmpdir.iterdir()) == []
    assert machine.witness.execute("query-status")["status"] == status


def assert_private_stub_open(machine: Vm, tmpdir: Path) -> None:
    (directory,) = tmpdir.iterdir()
    assert directory.name.startswith("qmpprof-gdb-")
    assert directory.stat().st_mode & 0o777 == 0o700
    assert "gdb" in machine.chardevs()


def test_a_run_takes_the_private_gdbstub_and_removes_it(tmp_path: Path, private_tmp: Path) -> None:
    out = tmp_path / "fast.folded"
    with vm(tmp_path, smp=2) as machine:
        proc = spawn(machine, private_tmp, "--duration", "2", "-o", str(out))
        head = wait_sampling(proc)
        assert FAST + "\n" in head, head
        assert_private_stub_open(machine, private_tmp)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert_left_clean(machine, private_tmp)
        assert machine.advances()
    assert "Traceback" not in err
    assert " 200 ticks" in err  # 2 s of guest run time at 10 ms
    assert sum(c for _, c in folded.parse(out.read_text())) == 400  # both vCPUs every tick


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_run_and_removes_the_gdbstub(
    tmp_path: Path, private_tmp: Path, signum: int
) -> None:
    out = tmp_path / "sig.folded"
    with vm(tmp_path, smp=1) as machine:
        proc = spawn(machine, private_tmp, "--duration", "60", "-o", str(out))
        wait_sampling(proc)
        machine_paused(machine, 5)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert_left_clean(machine, private_tmp)
        assert machine.advances()
    collected = re.search(r"^Samples: (\d+) ", err, re.MULTILINE)
    assert collected is not None and int(collected[1]) > 0, err
    assert sum(c for _, c in folded.parse(out.read_text())) == int(collected[1])


def test_qemu_killed_leaves_no_private_directory(tmp_path: Path, private_tmp: Path) -> None:
    out = tmp_path / "partial.folded"
    with vm(tmp_path, smp=1) as machine:
        proc = spawn(machine, private_tmp, "--duration", "60", "-o", str(out))
        wait_sampling(proc)
        machine_paused(machine, 5)
        machine.guest.process.kill()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 4, err
    assert "Traceback" not in err
    assert list(private_tmp.iterdir()) == []
    collected = re.search(r"^Samples: (\d+) ", err, re.MULTILINE)
    assert collected is not None and int(collected[1]) > 0, err
    assert sum(c for _, c in folded.parse(out.read_text())) == int(collected[1])


def test_an_error_at_the_end_still_removes_the_gdbstub(tmp_path: Path, private_tmp: Path) -> None:
    """The output's folder vanishes mid-run: writing fails with one line, the stub is gone."""
    folder = tmp_path / "vanishing"
    folder.mkdir()
    with vm(tmp_path, smp=1) as machine:
        proc = spawn(machine, private_tmp, "--duration", "2", "-o", str(folder / "x.folded"))
        wait_sampling(proc)
        folder.rmdir()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert err.splitlines()[-1].startswith("qmpprof: error: "), err
        assert "Traceback" not in err
        assert_left_clean(machine, private_tmp)


def test_a_paused_guest_stays_paused(tmp_path: Path, private_tmp: Path) -> None:
    with vm(tmp_path, smp=2, paused=True) as machine:
        proc = spawn(machine, private_tmp, "--duration", "2")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert FAST in err
        assert "the guest is paused: took one sample without resuming it" in err
        assert out.startswith("vCPU 0: ") and "vCPU 1: " in out
        assert_left_clean(machine, private_tmp, status="paused")
        assert not machine.advances()


def test_an_existing_gdbstub_is_not_taken_over(tmp_path: Path, private_tmp: Path) -> None:
    port = free_tcp_port()
    with vm(tmp_path, smp=1, gdb_port=port) as machine:
        proc = spawn(machine, private_tmp, "--duration", "1")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "the VM already has a gdbstub (chardev gdb): using QMP" in err
        assert f"pass --gdb 127.0.0.1:{port} to use it)" in err  # its own address, as QEMU says
        assert FAST not in err
        assert " 100 ticks" in err
        # The user's stub is where it was, unused, and still takes a client.
        assert "gdb" in machine.chardevs()
        assert list(private_tmp.iterdir()) == []

        async def attach() -> None:
            transport = await GdbTransport.connect(f"127.0.0.1:{port}", was_running=True)
            await transport.close()

        asyncio.run(attach())
        assert machine.witness.execute("query-status")["status"] == "running"


def test_transport_qmp_keeps_the_hmp_path(tmp_path: Path, private_tmp: Path) -> None:
    with vm(tmp_path, smp=1) as machine:
        proc = spawn(machine, private_tmp, "--transport", "qmp", "--duration", "0.5")
        head = wait_sampling(proc)
        assert "gdb" not in machine.chardevs()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "qmpprof: samples travel through QMP (--transport qmp)\n" in head


def guard_of(proc: subprocess.Popen[str]) -> int:
    """The pid of ``proc``'s pause guard (transport/guard.py): its one child process."""
    (child,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return int(child)


def test_a_stub_left_by_a_killed_qmpprof_is_removed_by_its_guard_or_the_next_run(
    tmp_path: Path, private_tmp: Path
) -> None:
    """SIGKILL: qmpprof's guard takes away the stub it left; with the guard killed first (a
    container torn down), the next run removes it."""
    with vm(tmp_path, smp=1) as machine:
        proc = spawn(machine, private_tmp, "--duration", "60")
        wait_sampling(proc)
        proc.kill()  # SIGKILL: no clean-up at all in qmpprof
        proc.communicate(timeout=30)  # to the end of stderr: the guard's exit too
        assert_left_clean(machine, private_tmp)

        proc = spawn(machine, private_tmp, "--duration", "60")
        wait_sampling(proc)
        os.kill(guard_of(proc), signal.SIGKILL)
        proc.kill()
        proc.communicate(timeout=30)
        (left,) = private_tmp.iterdir()
        assert machine.stub().startswith(f"disconnected:unix:{left}/gdb.sock")
        if machine.witness.execute("query-status")["status"] != "running":
            machine.witness.execute("cont")  # killed inside a pause, guard and all
        out = tmp_path / "next.folded"
        proc = spawn(machine, private_tmp, "--duration", "0.5", "-o", str(out))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        note = f"qmpprof: note: removed the gdbstub a qmpprof killed outright had left ({left}"
        assert note in err and FAST in err, err
        assert_left_clean(machine, private_tmp)
        assert sum(c for _, c in folded.parse(out.read_text())) == 50


def test_a_stub_that_is_not_a_dead_qmpprof_s_is_left_alone(
    tmp_path: Path, private_tmp: Path
) -> None:
    """A user's stub in a directory named as ours but not 0700 is left alone (the other ways a
    stub is not a leftover: tests/unit/test_transport_stubdir.py), and the run takes QMP."""
    with vm(tmp_path, smp=1) as machine:
        lookalike = private_tmp / "qmpprof-gdb-user1234"
        lookalike.mkdir(mode=0o755)
        lookalike.chmod(0o755)
        machine.witness.hmp(f"gdbserver unix:{lookalike}/gdb.sock,server=on,wait=off")
        proc = spawn(machine, private_tmp, "--duration", "0.2")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "the VM already has a gdbstub (chardev gdb): using QMP" in err
        assert f"pass --gdb unix:{lookalike}/gdb.sock to use it" in err
        assert machine.stub().startswith(f"disconnected:unix:{lookalike}/gdb.sock")
        assert (lookalike / "gdb.sock").exists()
        machine.witness.hmp("gdbserver none")
