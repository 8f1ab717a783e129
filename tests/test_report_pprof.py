"""``qmpprof report`` and ``qmpprof diff`` read pprof: the .pb.gz of a real run reports and
diffs as its .qmpprof does; a minimal pprof written by hand reads as far as it carries; damage
is one line."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest
from guestvm import running_guest

from qmpprof.cli import main
from qmpprof.output.protowire import Message


def hand_built_pprof() -> bytes:
    """Two stacks of one sample type, no labels, no mappings: what another tool may write."""
    strings = ["", "samples", "count", "main", "work", "app.c"]
    root = Message().message(1, Message().u64(1, 1).u64(2, 2))
    root.message(2, Message().packed(1, [2, 1]).packed(2, [3]))
    root.message(2, Message().packed(1, [1]).packed(2, [1]))
    root.message(4, Message().u64(1, 1).u64(3, 0x401000).message(4, Message().u64(1, 1)))
    root.message(4, Message().u64(1, 2).u64(3, 0x401100).message(4, Message().u64(1, 2)))
    root.message(5, Message().u64(1, 1).u64(2, 3).u64(4, 5))
    root.message(5, Message().u64(1, 2).u64(2, 4).u64(4, 5))
    for text in strings:
        root.string(6, text)
    return gzip.compress(root.encode())


def test_a_pprof_from_elsewhere_reads_as_far_as_it_carries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.pb.gz"
    path.write_bytes(hand_built_pprof())
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Top 2 of 2 stacks (4 samples)")
    assert "kernel;main;work" in out and "kernel;main\n" in out


@pytest.mark.parametrize(
    "data",
    [gzip.compress(b"\x0a\x05\x08"), gzip.compress(b"\xff" * 12), gzip.compress(b"\x12")],
)
def test_damaged_pprof_is_one_line(
    data: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.pb.gz"
    path.write_bytes(data)
    assert main(["report", str(path)]) == 7
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a pprof profile either" in err


@pytest.mark.qemu
def test_a_runs_pprof_reports_and_diffs_as_its_qmpprof(tmp_path: Path) -> None:
    with running_guest(tmp_path) as guest:
        base = ["--qmp-socket", str(guest.qmp_socket), "--kernel", str(guest.kernel_elf),
                "--user-dir", str(guest.user_dir), "--interval", "5",
                "--duration", "2"]  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-m", "qmpprof", *base, "--lines",
             "-o", str(tmp_path / "run.qmpprof"), "-o", str(tmp_path / "run.pb.gz")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "qmpprof", *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    for name in ("run.qmpprof", "run.pb.gz"):
        for flags in ((), ("--lines",), ("-k",)):
            out = tmp_path / f"{name}{''.join(flags)}.folded"
            cli("report", str(tmp_path / name), "-o", str(out), *flags)
        cli(
            "diff",
            str(tmp_path / name),
            str(tmp_path / name),
            "-o",
            str(tmp_path / f"{name}.diff.folded"),
        )
    for suffix in (".folded", "--lines.folded", "-k.folded", ".diff.folded"):
        native = (tmp_path / f"run.qmpprof{suffix}").read_text()
        pprof = (tmp_path / f"run.pb.gz{suffix}").read_text()
        assert native == pprof and native.count("\n") >= 3, suffix
    assert cli("report", str(tmp_path / "run.pb.gz")) == cli(
        "report", str(tmp_path / "run.qmpprof")
    )
    diff = cli("diff", str(tmp_path / "run.qmpprof"), str(tmp_path / "run.pb.gz"))
    assert all(" +0.00 pts " in line for line in diff.splitlines()[1:]), diff
