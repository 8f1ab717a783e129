"""scripts/setup's two plans, read from ``--dry-run`` in a copy of the checkout: the demo's (what
./scripts/demo sets up) names nothing the demo does not use, the full one (./scripts/test, CI)
still names everything; and the README's two commands, run in a checkout whose setup, qmpprof
and pytest only record how they were called, run the setup the README says they do."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from guestvm import ROOT

# What the demo never uses: the Linux and arm64 kernels and guests, unstable's QEMU, Prometheus,
# the browser tests' Chromium, the dev tools and the test-only packages.
NOT_FOR_THE_DEMO = (
    "fetch-linux", "fetch-linux-dbg", "build-linux-guest", "build-aarch64-guest", "arm",
    "riscv64",
    "fetch-qemu", "fetch-prometheus", "setup-browser", "[dev]", "gdb", "golang-go", "dwarves",
    "bpftool",
)  # fmt: skip
DEMO_PACKAGES = {"qemu-system-x86", "gcc", "binutils", "make"}


def checkout_copy(tmp_path: Path) -> Path:
    """scripts/ and pyproject.toml in a fresh folder: a checkout with nothing set up."""
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    shutil.copy(ROOT / "pyproject.toml", copy)
    return copy


def failing_tools(tmp_path: Path) -> dict[str, str]:
    """An environment where apt-get and the venv's python fail: a setup that tries to change
    the machine stops at once instead."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text("#!/bin/sh\necho apt-get called >&2\nexit 1\n")
    (bin_dir / "apt-get").chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON="/bin/false")


def plan(tmp_path: Path, *args: str) -> list[str]:
    copy = checkout_copy(tmp_path)
    done = subprocess.run(
        [copy / "scripts" / "setup", *args, "--dry-run"],
        env=failing_tools(tmp_path), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # Nothing made: no .venv, no fixtures/build.
    assert sorted(p.name for p in copy.iterdir()) == ["pyproject.toml", "scripts"]
    return done.stdout.splitlines()


def packages(lines: list[str]) -> set[str]:
    (line,) = (line for line in lines if line.startswith("packages: "))
    return set(line.removeprefix("packages: ").split(" (")[0].split())


def test_the_demo_plan_sets_up_only_what_the_demo_uses(tmp_path: Path) -> None:
    lines = plan(tmp_path, "demo")
    assert packages(lines) == DEMO_PACKAGES
    runs = [line for line in lines if line.startswith("run: ")]
    assert runs == [
        "run: /bin/false -m venv .venv",
        "run: .venv/bin/pip install -q --disable-pip-version-check -e .",
        "run: scripts/build-fixtures cfi",  # the demo's guest alone (no Rust kernel)
    ]
    named = [word for word in NOT_FOR_THE_DEMO if any(word in line for line in lines)]
    assert named == []


def test_the_full_plan_still_sets_up_everything(tmp_path: Path) -> None:
    lines = plan(tmp_path)
    assert packages(lines) == DEMO_PACKAGES | {
        "qemu-system-arm", "gdb-multiarch", "gcc-aarch64-linux-gnu", "gdb", "golang-go",
        "dwarves", "bpftool", "qemu-system-misc", "debuginfod", "tmux",
        "libvirt-daemon", "libvirt-clients", "pkg-config", "libvirt-dev",
        "libvirt-daemon-driver-qemu", "rustc",
    }  # fmt: skip
    series = ["6.12", "6.1", "5.10", "7", "arm64-6.1", "arm64-6.12", "arm64-7", "riscv64-6.12"]
    assert [line.removeprefix("run: ") for line in lines if line.startswith("run: ")] == [
        "/bin/false -m venv .venv",
        ".venv/bin/pip install -q --disable-pip-version-check -e .[dev]",
        # the order steps start in, when what each waits for has ended
        *(f"scripts/fetch-linux {s}" for s in series[:4]),
        "scripts/build-linux-guest",
        *(f"scripts/fetch-linux {s}" for s in series[4:6]),
        "scripts/build-aarch64-guest",
        "scripts/fetch-linux arm64-7",  # booted without the test module
        "scripts/fetch-linux riscv64-6.12",
        "scripts/build-riscv64-guest",
        "scripts/build-fixtures",
        "scripts/setup-browser",
        *(f"scripts/fetch-linux-dbg {s}" for s in series),
        "scripts/fetch-qemu",
        "scripts/fetch-prometheus",
    ]


def test_an_unknown_mode_is_refused(tmp_path: Path) -> None:
    copy = checkout_copy(tmp_path)
    done = subprocess.run(
        [copy / "scripts" / "setup", "everything"],
        env=failing_tools(tmp_path), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("setup: unknown argument everything\n")


UNIT = "pytest -ra -x -n auto -m not qemu"  # scripts/test's two tiers, as the stub pytest logs them
QEMU = "pytest -ra --durations=25 --junitxml=.cache/qemu-tier.xml -m qemu"


def recording_checkout(tmp_path: Path) -> tuple[Path, Path]:
    """scripts/demo, scripts/test and .ci/run as they are, beside a scripts/setup, a
    scripts/mutate and a .venv/bin/{qmpprof,pytest} that only write their name and arguments to
    a log."""
    copy, log = tmp_path / "checkout", tmp_path / "calls.log"
    for name in ("scripts/demo", "scripts/test", ".ci/run"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, copy / name)
    (copy / ".venv" / "bin").mkdir(parents=True)
    for name in ("scripts/setup", "scripts/mutate", ".venv/bin/qmpprof", ".venv/bin/pytest"):
        stub = copy / name
        stub.write_text(f'#!/bin/sh\necho "{stub.name} $*" >>{log}\n')
        stub.chmod(0o755)
    return copy, log


def test_the_readme_commands_set_up_what_they_say(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("\n\n", 2)[1]
    commands = re.findall(r"^ {4}(\./scripts/\S+)", block, re.MULTILINE)
    assert commands == ["./scripts/demo", "./scripts/test"]
    assert "`scripts/setup demo`" in readme and "`./scripts/test` sets up everything" in readme
    copy, log = recording_checkout(tmp_path)
    runs = [[command] for command in [*commands, ".ci/run"]] + [["./scripts/test", "-k", "x"]]
    for argv in runs:
        done = subprocess.run([copy / argv[0], *argv[1:]], cwd=copy, timeout=60, check=False)
        assert done.returncode == 0, argv
    assert log.read_text().splitlines() == [
        "setup demo", "qmpprof demo",  # ./scripts/demo
        "setup ", UNIT, "mutate ", QEMU,  # ./scripts/test
        "setup ", UNIT, "mutate ", QEMU,  # .ci/run
        # ./scripts/test with tests chosen: no mutation check
        "setup ", f"{UNIT} -k x", f"{QEMU} -k x",
    ]  # fmt: skip


# pytest's exit codes for each tier (0 passed, 1 failed, 5 selected nothing) and what
# scripts/test then runs and exits with.
TIERS = [
    ((0, 0), 2, 0),
    ((1, 0), 1, 1),  # a unit failure stops before the QEMU tier
    ((0, 1), 2, 1),
    ((5, 0), 2, 0),
    ((0, 5), 2, 0),
    ((5, 5), 2, 5),
    ((2, 0), 1, 2),  # interrupted or a usage error
]


@pytest.mark.parametrize(("codes", "runs", "exit_code"), TIERS, ids=[str(t[0]) for t in TIERS])
def test_the_unit_tier_runs_first_and_every_failure_is_the_exit_code(
    tmp_path: Path, codes: tuple[int, int], runs: int, exit_code: int
) -> None:
    copy, log = recording_checkout(tmp_path)
    unit, qemu = codes
    (copy / ".venv/bin/pytest").write_text(
        f'#!/bin/sh\necho "pytest $*" >>{log}\n'
        f'case "$*" in *"not qemu"*) exit {unit};; *) exit {qemu};; esac\n'
    )
    done = subprocess.run([copy / "scripts/test", "-k", "x"], cwd=copy, timeout=60, check=False)
    assert done.returncode == exit_code
    calls = [line for line in log.read_text().splitlines() if line.startswith("pytest")]
    assert calls == [f"{UNIT} -k x", f"{QEMU} -k x"][:runs]


def stub(path: Path, log: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{path.name} $*" >>{log}\n')
    path.chmod(0o755)


def system_tools(tmp_path: Path, log: Path) -> dict[str, str]:
    """An environment where every tool setup looks for is there (stubs logging their calls)."""
    tools = (
        "qemu-system-x86_64", "gcc", "ld", "make", "qemu-system-aarch64", "gdb-multiarch",
        "aarch64-linux-gnu-gcc", "qemu-system-riscv64", "gdb", "go", "pahole", "bpftool",
        "apt-get",
    )  # fmt: skip
    for tool in tools:
        stub(tmp_path / "bin" / tool, log)
    return dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")


def test_the_venv_is_installed_once_and_a_demo_install_is_no_full_one(tmp_path: Path) -> None:
    """With every system tool present (stubs on PATH), a .venv whose pip only logs: the demo
    installs the runtime dependencies once; the full setup adds the dev tools after it; a full
    install then serves the demo."""
    copy, log = tmp_path / "checkout", tmp_path / "calls.log"
    (copy / "scripts").mkdir(parents=True)
    for name in ("scripts/setup", "scripts/linux-series.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    for name in (".venv/bin/python", ".venv/bin/pip", "scripts/build-fixtures"):
        stub(copy / name, log)
    env = system_tools(tmp_path, log)
    pip = "pip install -q --disable-pip-version-check -e"
    for args, calls in [
        (["demo"], [f"{pip} .", "build-fixtures cfi"]),
        (["demo"], ["build-fixtures cfi"]),
        ([], [f"{pip} .[dev]", "build-fixtures "]),
        (["demo"], ["build-fixtures cfi"]),
        ([], ["build-fixtures "]),
    ]:
        log.write_text("")
        done = subprocess.run(
            [copy / "scripts" / "setup", *args],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        # (the venv's install and the build run side by side: in either order)
        assert sorted(log.read_text().splitlines()) == sorted(calls), args
