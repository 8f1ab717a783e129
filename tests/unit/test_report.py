"""``qmpprof report``: a saved profile rendered again, in any format and naming, filtered.

The unit tests use a hand-built profile; the end-to-end test profiles the real bundled guest
once, with source lines, and re-renders that one run in every naming."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from guestvm import running_guest
from test_output import hand_built_profile

from qmpprof.cli import main
from qmpprof.output import folded, render


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


def strip_detail(names: tuple[str, ...]) -> tuple[str, ...]:
    """A name with +offset or (file:line) -> the function's name, suffixes kept."""
    return tuple(re.sub(r"\+0x[0-9a-f]+| \([^()]*:\d+\)", "", n) for n in names)


def profile_bundled_guest(tmp_path: Path, *outputs: Path) -> None:
    """A 2 s run of qmpprof on the bundled guest at 5 ms, named with --lines, into ``outputs``."""
    with running_guest(tmp_path) as guest:
        base = ["--qmp-socket", str(guest.qmp_socket), "--kernel", str(guest.kernel_elf),
                "--user-dir", str(guest.user_dir), "--interval", "5",
                "--duration", "2", "--lines"]  # fmt: skip
        written = [arg for path in outputs for arg in ("-o", str(path))]
        run = subprocess.run(
            [sys.executable, "-m", "qmpprof", *base, *written],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr


@pytest.mark.qemu
def test_one_run_re_renders_in_every_naming_with_the_same_counts(tmp_path: Path) -> None:
    profile_bundled_guest(tmp_path, tmp_path / "run.qmpprof", tmp_path / "run.folded")
    direct = Counter(dict(folded.parse((tmp_path / "run.folded").read_text())))
    rendered: dict[str, Counter[tuple[str, ...]]] = {}
    for flag in ("--lines", "--offsets", None):
        out = tmp_path / f"again{flag or ''}.folded"
        argv = ["report", str(tmp_path / "run.qmpprof"), "-o", str(out)]
        assert main(argv + ([flag] if flag else [])) == 0
        rendered[flag or "function"] = Counter(dict(folded.parse(out.read_text())))
    # The run's own --lines output and the saved profile rendered with --lines are one thing.
    assert rendered["--lines"] == direct
    total = sum(direct.values())
    assert total >= 200 and all(sum(c.values()) == total for c in rendered.values())
    assert any("(" in n and ".c:" in n for names in direct for n in names), "no source lines"
    # Offsets and lines only refine function names: folded back, every naming agrees.
    plain = rendered["function"]
    for detail in ("--offsets", "--lines"):
        merged: Counter[tuple[str, ...]] = Counter()
        for names, count in rendered[detail].items():
            merged[tuple(n for n in strip_detail(names) if "_[i]" not in n)] += count
        assert merged == plain, detail
    assert any("+0x" in n for names in rendered["--offsets"] for n in names)
