"""``qmpprof demo``: its arguments, finding and building the bundled guest, and what it prints
(real runs: tests/e2e/test_demo_run.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fakes import profile_of
from guestvm import ROOT

from qmpprof.cli import demo, main
from qmpprof.errors import QmpprofError, UsageError


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
