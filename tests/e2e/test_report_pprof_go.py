"""``qmpprof report`` and ``qmpprof diff`` read pprof: the .pb.gz of a real run of the bundled
guest reports and diffs as its .qmpprof does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_report_rerender import profile_bundled_guest


@pytest.mark.qemu
def test_a_runs_pprof_reports_and_diffs_as_its_qmpprof(tmp_path: Path) -> None:
    profile_bundled_guest(tmp_path, tmp_path / "run.qmpprof", tmp_path / "run.pb.gz")

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
