"""``qmpprof diff`` on a real run of the bundled guest against its own kernel-only part: the user
code is shown gone."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from guestvm import running_guest
from qemus import every_qemu
from svgdiff import blue, legend_of, red, tooltips

from qmpprof.cli import main
from qmpprof.model import Mode
from qmpprof.output import diff, native
from qmpprof.profile import share_margin


@pytest.mark.qemu
@every_qemu
def test_diff_of_a_guest_run_and_its_kernel_only_part_shows_user_code_gone(
    tmp_path: Path,
) -> None:
    run_file, kernel_file = tmp_path / "run.qmpprof", tmp_path / "kernel.qmpprof"
    with running_guest(tmp_path) as guest:
        argv = [
            "--qmp-socket",
            str(guest.qmp_socket),
            "--kernel",
            str(guest.kernel_elf),
            "--user-dir",
            str(guest.user_dir),
            "--interval",
            "5",
            "--duration",
            "2",
        ]
        qmpprof = [sys.executable, "-m", "qmpprof"]
        run = subprocess.run([*qmpprof, *argv, "-o", str(run_file)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert main(["report", str(run_file), "-k", "-o", str(kernel_file)]) == 0
    out = {ext: tmp_path / f"diff.{ext}" for ext in ("folded", "svg")}
    cmd = [*qmpprof, "diff", str(run_file), str(kernel_file)]
    for path in out.values():
        cmd += ["-o", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = subprocess.run(cmd[:6], capture_output=True, text=True, timeout=120).stdout
    # Folded: both counts per stack; the user-mode samples are all in BEFORE only.
    rows = [line.rsplit(" ", 2) for line in out["folded"].read_text().splitlines()]
    everything, kernel = native.load(run_file), native.load(kernel_file)
    assert sum(int(b) for _, b, _ in rows) == len(everything) >= 200
    assert sum(int(a) for _, _, a in rows) == len(kernel) < len(everything)
    user = [(int(b), int(a)) for stack, b, a in rows
            if "_[k]" not in stack and not stack.startswith("kernel;")]  # fmt: skip
    assert all(a == 0 for _, a in user)
    assert sum(b for b, _ in user) == len(everything.select(Mode.USER)) > 20
    # SVG: user code went away (blue, on the BEFORE-only base), kernel work's share grew (red).
    frames = tooltips(out["svg"].read_text())
    fill, tip = frames[diff.GONE, 1]
    assert blue(fill) and "after 0, 0.00%" in tip
    gone = [name for name, depth in frames if depth > 2 and name == "spin_mix"]
    assert gone and all(blue(frames[name, d][0]) for name, d in frames if name == "spin_mix")
    assert red(frames["kworker_main_[k]", 3][0]) and red(frames["kernel", 1][0])
    assert "spin_mix" in printed and "pts" in printed
    # Full colour starts past the noise of these two runs' sample counts, and the legend says so.
    noise = math.hypot(share_margin(len(everything)), share_margin(len(kernel)))
    texts = legend_of(out["svg"].read_text())
    assert texts[2] == f"this pale or paler: within the noise, ±{noise:.1f} points (95 %)"
    assert float(texts[0].split()[1]) >= round(noise, 1)
    for fill, tip in frames.values():
        if "within the noise" in tip:
            assert fill not in (diff._fill(1.0), diff._fill(-1.0)), tip
