"""The offline benchmark measures a real, complete unwind (not an early exit)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from support.synthetic import load_time, offline_rate, running_code_path, synthetic_stack

from qmpprof.arch.x86 import X86_64
from qmpprof.elf.image import ElfImage
from qmpprof.model import StopReason
from qmpprof.unwind.chain import Unwinder, Via

DATA = Path(__file__).parents[1] / "data" / "unwind"


def test_synthetic_stack_unwinds_through_every_chosen_frame(tmp_path: Path) -> None:
    binary = tmp_path / "work"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(binary), str(DATA / "work.c")], check=True)
    image = ElfImage.load(binary)
    regs, cache, space, depth = synthetic_stack(image, depth=12)
    raw = Unwinder(X86_64).unwind(regs, cache, space)
    assert len(raw.pcs) == depth == 12
    assert raw.stop is StopReason.END
    assert set(raw.via[1:]) == {Via.CFI}
    assert len(set(raw.pcs)) == 12
    assert all(frame.symbol for frame in Unwinder(X86_64).resolve(raw, space).frames)


def test_offline_rate_and_load_time_report_numbers() -> None:
    path = running_code_path()
    assert path.is_file()
    assert offline_rate(path, samples=50) > 0
    times = load_time(path)
    assert times["symbols"] > 0 and times["load_s"] > 0
