"""qmpprof killed with SIGKILL inside a pause (transport/guard.py): the real command line against
the real bundled guest, sampling every millisecond (the guest stands stopped about half of the
time), killed the moment a witness QMP connection sees the guest stopped. After each kill the
guest runs again within a few seconds, and over the kills the guard said at least once that it
resumed the guest; a guest the user had paused stays paused (qmpprof never stopped it), killed
at moments its run defines: as it starts, once connected, once sampling."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from witnessvm import Vm, vm

pytestmark = pytest.mark.qemu

KILLS = 8
ROOT = Path(__file__).resolve().parents[2]
RESUMED = "qmpprof: guard: qmpprof ended inside a pause"
STOPPED = ("paused", "debug")


def start(machine: Vm, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "qmpprof", "--qmp-socket", machine.socket,
               "--interval", "1", "--duration", "60", "-o", str(out), *extra]  # fmt: skip
    return subprocess.Popen(
        command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def ended(run: subprocess.Popen[bytes]) -> str:
    """The run's standard error, to its end: the guard holds it until it exits too."""
    _, err = run.communicate(timeout=30)
    return err.decode()


def status(machine: Vm) -> str:
    found: str = machine.witness.execute("query-status")["status"]
    return found


def kill_in_a_pause(machine: Vm, run: subprocess.Popen[bytes], deadline: float) -> None:
    """SIGKILL ``run`` the moment the witness sees the guest stopped, once it samples."""
    while time.monotonic() < deadline:
        if status(machine) in STOPPED:
            os.kill(run.pid, signal.SIGKILL)
            return
        assert run.poll() is None, ended(run)
    os.kill(run.pid, signal.SIGKILL)
    raise AssertionError("the guest was never seen stopped")


def settled(machine: Vm, want: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while (now := status(machine)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_a_run_killed_inside_a_pause_leaves_the_guest_running(tmp_path: Path) -> None:
    said = 0
    with vm(tmp_path, smp=1) as machine:
        for i in range(KILLS):
            run = start(machine, tmp_path / f"run{i}.folded")
            kill_in_a_pause(machine, run, time.monotonic() + 60)
            err = ended(run)
            assert run.returncode == -signal.SIGKILL, err
            assert settled(machine, "running") == "running", f"kill {i}: the guest stays stopped"
            assert "Traceback" not in err, err
            said += err.count(RESUMED)
        assert said >= 1, "no kill landed inside a pause"
        print(f"the guard resumed the guest after {said} of {KILLS} kills")


# Moments of a run, each by the line qmpprof writes there (-v): connected (its transport
# chosen, the private gdbstub opened), sampling (its start line); or none: as it starts.
MOMENTS = {
    "starting": None,
    "connected": "qmpprof: samples travel through ",
    "sampling": "qmpprof: sampling ",
}
SAMPLING_TRIES = 5  # a paused guest is sampled once: the kill may come after that sample


def kill_at(run: subprocess.Popen[bytes], line: str | None, deadline: float) -> str:
    """SIGKILL ``run`` as soon as it writes a line starting with ``line`` (None: at once);
    what it wrote before."""
    assert run.stderr is not None
    seen = b""
    while line is not None and not any(
        text.startswith(line) for text in seen.decode().splitlines()
    ):
        ready, _, _ = select.select([run.stderr], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(run.stderr.fileno(), 4096) if ready else b""
        assert chunk, f"no {line!r} line by the deadline:\n{seen.decode()}"
        seen += chunk
    os.kill(run.pid, signal.SIGKILL)
    return seen.decode()


def test_a_guest_the_user_paused_stays_paused_when_qmpprof_is_killed(tmp_path: Path) -> None:
    """qmpprof samples a stopped guest without stopping it: killed at any moment of its run,
    nothing is owed, and the guard leaves the guest as the user had it. Each kill is seen to
    land in the run (SIGKILL its end, before its summary), the last while it samples."""
    with vm(tmp_path, smp=1, paused=True) as machine:
        landed = dict.fromkeys(MOMENTS, 0)
        for moment, line in MOMENTS.items():
            for _ in range(SAMPLING_TRIES if moment == "sampling" else 1):
                run = start(machine, tmp_path / "run.folded", "-v")
                before = kill_at(run, line, time.monotonic() + 60)
                err = before + ended(run)
                assert RESUMED not in err and "Traceback" not in err, err
                assert status(machine) == "paused", err
                if run.returncode == -signal.SIGKILL and "Samples: " not in before:
                    landed[moment] += 1
                    break
        print(f"kills that landed in the run, by moment: {landed}")
        assert all(landed.values()), landed
