"""A stock Linux kernel image loaded cold, phase by phase: each run is a Python process of its
own (imports included), as a user's first ``qmpprof --kernel vmlinuz`` is. The issue's budget
for the whole load (unpack, kallsyms, ORC index, BTF) is 2 s cold.

``python -m support.bench.linuxload VMLINUZ`` prints one run's phases as JSON.
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import json  # noqa: E402 (the clock starts before the imports it measures)
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402


def phases(path: Path) -> dict[str, float]:
    """Milliseconds of each phase, in this (fresh) process."""
    from qmpprof.elf.image import ElfImage
    from qmpprof.linux.bzimage import vmlinux_bytes
    from qmpprof.linux.kallsyms import read_kallsyms

    marks = {"imports": time.perf_counter()}
    elf = vmlinux_bytes(path.read_bytes(), str(path))
    marks["unpack"] = time.perf_counter()
    symbols = read_kallsyms(ElfImage.from_bytes(str(path), elf))
    marks["kallsyms"] = time.perf_counter()
    symbols.symbol_table()
    marks["symbol_table"] = time.perf_counter()
    out, before = {}, _START
    for name, mark in marks.items():
        out[name] = (mark - before) * 1e3
        before = mark
    out["total"] = (before - _START) * 1e3
    return out


def linux_load(path: Path, log: Callable[[str], None], repeat: int = 3) -> dict[str, object]:
    """``linux_load_ms``: the median of each phase over ``repeat`` cold runs, or None without
    the image (scripts/fetch-linux brings it)."""
    if not path.exists():
        log(f"linux load: {path} is missing (scripts/fetch-linux): not measured")
        return {"linux_load_ms": None}
    runs = []
    for _ in range(repeat):
        done = subprocess.run(
            [sys.executable, "-m", "support.bench.linuxload", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            log(f"linux load: {done.stderr.strip().splitlines()[-1:]}")
            return {"linux_load_ms": None}
        runs.append(json.loads(done.stdout))
    return {"linux_load_ms": {key: statistics.median(r[key] for r in runs) for key in runs[0]}}


if __name__ == "__main__":
    print(json.dumps(phases(Path(sys.argv[1]))))
