"""``qmpprof demo``: its arguments, finding and building the bundled guest, what it prints, and one
real run (a subprocess in a fresh directory) that must leave demo.svg and demo.folded holding the
bundled guest's workload functions (fixtures/guest/expected.json)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import profile_of
from guestvm import ROOT, build_fixtures, expected
from qemus import every_qemu

from qmpprof.cli import demo, main
from qmpprof.errors import QmpprofError, UsageError
from qmpprof.output import folded

RUN_TIMEOUT = 180.0  # boot, 2 s of guest run time and the pauses, on a loaded 2-core host


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--smp", "9"], "qmpprof: error: --smp must be 1..4 (what the bundled kernel supports)"),
        (["--variant", "x"], "qmpprof: error: argument --variant: invalid choice: 'x'"),
        (["-o", "a.folded"], "qmpprof: error: -o names the SVG flame graph (e.g. demo.svg)"),
    ],
)
def test_bad_arguments_are_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_missing_qemu_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no QEMU on PATH
    assert main(["demo"]) == 1
    assert capsys.readouterr().err == (
        "qmpprof: error: qemu-system-x86_64 not found:"
        " install QEMU (Debian: apt-get install qemu-system-x86)\n"
    )


def test_the_folded_file_sits_next_to_the_flame_graph() -> None:
    assert demo.folded_path(Path("out/demo.svg")) == Path("out/demo.folded")
    assert demo.folded_path(Path("flame")) == Path("flame.folded")
    with pytest.raises(UsageError):
        demo.folded_path(Path("x.folded"))


def test_the_checkout_is_the_one_this_package_runs_from(tmp_path: Path) -> None:
    assert demo.find_checkout(tmp_path) == ROOT


def fake_checkout(tmp_path: Path, script: str) -> Path:
    (tmp_path / "scripts").mkdir()
    build = tmp_path / "scripts" / "build-fixtures"
    build.write_text(f"#!/bin/sh\n{script}\n")
    build.chmod(0o755)
    return tmp_path


def test_a_missing_build_is_built_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkout = fake_checkout(
        tmp_path,
        'cd "$(dirname "$0")/.." && mkdir -p fixtures/build/fp/user'
        " && touch fixtures/build/fp/kernel.elf fixtures/build/fp/user/a.elf && echo built",
    )
    build = demo.ensure_built(checkout, "fp", sys.stderr)
    assert build == checkout / "fixtures" / "build" / "fp"
    err = capsys.readouterr().err
    assert "qmpprof: building the bundled guest" in err
    # Built now: a second call runs nothing.
    assert demo.ensure_built(checkout, "fp", sys.stderr) == build
    assert "building" not in capsys.readouterr().err


def test_a_failed_build_is_one_error(tmp_path: Path) -> None:
    checkout = fake_checkout(tmp_path, "exit 3")
    with pytest.raises(QmpprofError, match=r"building the bundled guest failed \(.* exited 3\)"):
        demo.ensure_built(checkout, "cfi", sys.stderr)


def test_hottest_lists_self_samples_most_first() -> None:
    profile = profile_of(
        [("kernel", "a", "b"), ("kernel", "a", "b"), ("kernel", "a"), ("p (pid 1)", "c_[k]")]
    )
    lines = demo.hottest(profile).splitlines()
    assert lines[0].startswith("Hottest functions (4 samples")
    assert [line.split() for line in lines[1:]] == [
        ["2", "50.0%", "b"],
        ["1", "25.0%", "a"],
        ["1", "25.0%", "c_[k]"],
    ]
    assert demo.hottest(profile_of([])) == "No samples.\n"


def workload_functions() -> set[str]:
    """Every function of the guest's workload stacks (expected.json), as folded names."""
    spec = expected()
    names = set(spec["kernel_threads"]["kworker"]["shares"])
    for program in spec["programs"].values():
        names |= set(program["shares"])
    # Kernel frames carry the _[k] mark: the kernel thread's and the system call's.
    kernel_side = set(spec["syscall_path"]) | set(spec["kernel_threads"]["kworker"]["shares"])
    return {f"{n}_[k]" if n in kernel_side else n for n in names}


@pytest.mark.qemu
@every_qemu
def test_demo_writes_the_flame_graph_and_folded_stacks_here(tmp_path: Path) -> None:
    build_fixtures()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qmpprof", "demo", "--duration", "2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its QEMU too: killed whole should the test fail half-way
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    svg, folded_file = tmp_path / "demo.svg", tmp_path / "demo.folded"
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))
    seen = {name for names, _ in folded.parse(folded_file.read_text()) for name in names}
    assert workload_functions() <= seen, sorted(workload_functions() - seen)
    assert out.startswith("Hottest functions (")
    assert f"Flame graph: {svg.as_uri()}" in out
    assert "Traceback" not in err


@pytest.mark.qemu
@every_qemu
@pytest.mark.parametrize("variant", ["i386", "i386-pae"])
def test_demo_takes_the_i386_builds(tmp_path: Path, variant: str) -> None:
    """``--variant i386`` (and ``i386-pae``, with PAE paging): the 32-bit build in
    qemu-system-i386, processes told apart by CR3."""
    build_fixtures((variant,))
    command = [sys.executable, "-m", "qmpprof", "demo", "--variant", variant, "--duration", "2"]
    proc = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    stacks = folded.parse((tmp_path / "demo.folded").read_text())
    seen = {name for names, _ in stacks for name in names}
    assert workload_functions() <= seen, sorted(workload_functions() - seen)
    assert any(names[0].startswith("spin (cr3=") for names, _ in stacks)
    assert out.startswith("Hottest functions (")
