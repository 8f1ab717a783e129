"""``qmpprof report``: a saved profile rendered again, in any format and naming, filtered, on a
hand-built profile (a real run: tests/e2e/test_report_rerender.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_output import hand_built_profile

from qmpprof.cli import main
from qmpprof.output import render


def saved(tmp_path: Path) -> Path:
    path = tmp_path / "run.qmpprof"
    path.write_bytes(render(hand_built_profile(), "qmpprof"))
    return path


def test_report_writes_every_format_from_a_saved_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outs = [tmp_path / n for n in ("a.folded", "a.svg", "a.speedscope.json")]
    args = ["report", str(saved(tmp_path))]
    assert main([*args, *(x for out in outs for x in ("-o", str(out)))]) == 0
    assert outs[0].read_bytes() == render(hand_built_profile(), "folded")
    assert outs[1].read_bytes() == render(hand_built_profile(), "svg")
    assert outs[2].read_bytes() == render(hand_built_profile(), "speedscope")
    assert capsys.readouterr().err.count("Wrote ") == 3


def test_report_filters_and_prints_top_stacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(saved(tmp_path)), "--cpus", "1", "-k"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Top 1 of 1 stacks (1 samples)")
    assert "kernel;[truncated];page_fault" in out


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["report"], 2, "the following arguments are required: PROFILE"),
        (["report", "{missing}"], 7, "not a readable qmpprof profile"),
        (["report", "{bad}"], 7, "not gzipped JSON"),
        (["report", "{good}", "-o", "x.png", "--format", "png"], 2, "unknown format 'png'"),
    ],
)
def test_report_errors_are_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    message: str,
) -> None:
    bad = tmp_path / "bad.qmpprof"
    bad.write_text("garbage")
    names = {"missing": tmp_path / "no.qmpprof", "bad": bad, "good": saved(tmp_path)}
    assert main([a.format(**names) for a in argv]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qmpprof: error: ") and message in err
