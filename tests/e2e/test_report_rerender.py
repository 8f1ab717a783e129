"""``qmpprof report`` on the real bundled guest: one run profiled, with source lines, and
re-rendered in every naming with the same counts."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from guestvm import running_guest

from qmpprof.cli import main
from qmpprof.output import folded


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
