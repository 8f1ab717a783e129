"""scripts/setup's steps side by side, in a checkout whose step scripts (and the venv's pip) are
stubs that log when they start and end and do what each test asks: never more at once than
QMPPROF_SETUP_JOBS, each after the steps it needs, each one's output printed whole; a step that
fails, or a signal to setup, stops the others and leaves none of their processes behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from guestvm import ROOT
from test_setup import system_tools

SCRIPTS = (
    "fetch-linux", "fetch-linux-dbg", "build-linux-guest", "build-aarch64-guest",
    "build-riscv64-guest", "build-fixtures", "setup-browser", "fetch-qemu", "fetch-prometheus",
)  # fmt: skip
X86, ARM64, RISCV64 = ["6.12", "6.1", "5.10", "7"], ["arm64-6.1", "arm64-6.12"], ["riscv64-6.12"]
STEPS = {
    "pip install": [],
    **{f"fetch-linux {s}": [] for s in [*X86, *ARM64, "arm64-7", *RISCV64]},
    "build-linux-guest": [f"fetch-linux {s}" for s in X86],
    "build-aarch64-guest": [f"fetch-linux {s}" for s in ARM64],
    "build-riscv64-guest": [],
    "build-fixtures": [],
    "setup-browser": ["pip install"],
    **{f"fetch-linux-dbg {s}": [f"fetch-linux {s}"] for s in [*X86, *ARM64, "arm64-7", *RISCV64]},
    "fetch-qemu": [],
    "fetch-prometheus": [],
}  # the step each stub logs as (its name and first argument) -> the steps it needs ended first

# A step: logs its start and end, and between them runs $STEPS/<step>.sh if the test wrote one.
# waitfor FILE waits for it to exist (a 30 s deadline: the step fails); hold records the
# step's process and a child of it (the file whole once there), then waits on the child (until
# stopped).
STUB = """#!/bin/sh
step="$(basename "$0")${1:+ $1}"
waitfor() {
    i=0
    until [ -e "$STEPS/$1" ]; do
        i=$((i + 1)) && [ "$i" -lt 600 ] || exit 9
        sleep 0.05
    done
}
hold() {
    sleep 600 &
    echo "$$ $!" >"$STEPS/.pids $step" && mv "$STEPS/.pids $step" "$STEPS/pids $step"
    wait
}
echo "start $step" >>"$STEPS/events"
: >"$STEPS/started $step"
echo "$step: starts"
[ ! -f "$STEPS/$step.sh" ] || . "$STEPS/$step.sh"
echo "$step: ends"
echo "end $step" >>"$STEPS/events"
"""


def checkout(tmp_path: Path, steps: dict[str, str]) -> tuple[Path, Path, dict[str, str]]:
    """A checkout with the real setup and stub steps (doing what ``steps`` says), its steps'
    folder, and the environment to run setup in (3 steps at once)."""
    copy, folder = tmp_path / "checkout", tmp_path / "steps"
    (copy / "scripts").mkdir(parents=True)
    folder.mkdir()
    for name in ("scripts/setup", "scripts/linux-series.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    for name in (*(f"scripts/{s}" for s in SCRIPTS), ".venv/bin/python", ".venv/bin/pip"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_text(STUB)
        (copy / name).chmod(0o755)
    for step, body in steps.items():
        (folder / f"{step}.sh").write_text(body)
    env = system_tools(tmp_path, tmp_path / "tools.log")
    return copy, folder, dict(env, STEPS=str(folder), QMPPROF_SETUP_JOBS="3")


def events(folder: Path) -> list[tuple[str, str]]:
    lines = (folder / "events").read_text().splitlines()
    return [(what, step) for what, step in (line.split(" ", 1) for line in lines)]


def test_steps_run_side_by_side_each_after_what_it_needs(tmp_path: Path) -> None:
    # The first three steps wait for one another: they can only end if they run at once.
    first = ["pip install", "fetch-linux 6.12", "fetch-linux 6.1"]
    barrier = {step: "".join(f'waitfor "started {o}"\n' for o in first) for step in first}
    copy, folder, env = checkout(tmp_path, barrier)
    done = subprocess.run(
        [copy / "scripts/setup"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    ended: set[str] = set()
    running: set[str] = set()
    most = 0
    for what, step in events(folder):
        if what == "start":
            assert set(STEPS[step]) <= ended, step
            running.add(step)
            most = max(most, len(running))
        else:
            running.remove(step)
            ended.add(step)
    assert ended == set(STEPS)
    assert most == 3
    # Each script step's output whole, then how long it took.
    lines = done.stderr.splitlines()
    for step in set(STEPS) - {"pip install"}:
        at = lines.index(f"{step}: starts")
        assert lines[at + 1] == f"{step}: ends"
        assert re.fullmatch(rf"setup: scripts/{step} took \d+ s", lines[at + 2])


def left_behind(folder: Path) -> list[int]:
    """The processes the held steps started (each stub's shell and its child) still running."""
    pids = [int(pid) for f in folder.glob("pids *") for pid in f.read_text().split()]
    assert len(pids) == 4  # two steps held
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":  # a zombie has ended (its new parent has not reaped it yet)
            alive.append(pid)
    return alive


def test_a_failed_step_fails_setup_and_stops_the_others(tmp_path: Path) -> None:
    held = ["pip install", "fetch-linux 6.12"]
    steps = {step: "hold\n" for step in held}
    steps["fetch-linux 6.1"] = (
        "".join(f'waitfor "pids {s}"\n' for s in held) + "echo boom\nexit 3\n"
    )
    copy, folder, env = checkout(tmp_path, steps)
    done = subprocess.run(
        [copy / "scripts/setup"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 1
    assert re.search(
        r"^fetch-linux 6\.1: starts\nboom\nsetup: scripts/fetch-linux 6\.1 took \d+ s\n"
        r"setup: scripts/fetch-linux 6\.1 failed \(exit status 3\): its log is above\n",
        done.stderr, re.MULTILINE,
    )  # fmt: skip
    assert "setup: stopping scripts/fetch-linux 6.12\n" in done.stderr
    assert left_behind(folder) == []
    # Nothing started after the failure, nothing held ended.
    assert sorted(events(folder)) == sorted([("start", s) for s in [*held, "fetch-linux 6.1"]])


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_setup_stops_every_step(tmp_path: Path, sig: int, code: int) -> None:
    held = ["pip install", "fetch-linux 6.12", "fetch-linux 6.1"]
    copy, folder, env = checkout(tmp_path, {step: "hold\n" for step in held[:2]})
    (folder / "fetch-linux 6.1.sh").write_text("waitfor never\n")
    setup = subprocess.Popen(
        [copy / "scripts/setup"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while (
        not all((folder / f"started {s}").exists() for s in held)
        or len(list(folder.glob("pids *"))) < 2
    ):
        assert time.monotonic() < deadline and setup.poll() is None
        time.sleep(0.05)
    os.kill(setup.pid, sig)
    _, stderr = setup.communicate(timeout=60)
    assert setup.returncode == code, stderr
    assert left_behind(folder) == []
    assert sorted(events(folder)) == sorted([("start", s) for s in held])
