"""The offline half of the cost: loading ELF files (symbols, CFI) and unwinding plus naming
samples with no guest involved. The unwinder's own benchmark (``support.synthetic``) does the
measuring; this module picks the ELF files and keeps going if it is missing or fails."""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qmpprof.elf.image import ElfImage
from support.bench.linuxload import linux_load

LINUX_IMAGE = Path(__file__).resolve().parents[3] / "fixtures" / "build" / "linux" / "vmlinuz"


def elf_load_ms(path: Path, repeat: int = 3) -> float:
    """Median milliseconds to load an ELF and build its symbol index and CFI table."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        image = ElfImage.load(path)
        _ = image.symbols, image.cfi  # both are built on first access
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def offline(kernel: Path, log: Callable[[str], None]) -> dict[str, object]:
    """``elf_load_ms`` (the guest kernel), ``linux_load_ms`` (the Debian bzImage's cold load,
    by phase), and from ``support.synthetic``: ``offline_samples_per_s`` (a 10-frame stack
    through the CFI of the largest ELF mapped into this Python) and ``elf_load_big`` (load,
    symbols and CFI index times of that ELF)."""
    out: dict[str, object] = {
        "elf_load_ms": elf_load_ms(kernel),
        **linux_load(LINUX_IMAGE, log),
        "offline_samples_per_s": None,
        "elf_load_big": None,
    }
    try:
        unwind_bench: Any = importlib.import_module("support.synthetic")
    except ImportError:
        log("offline: support.synthetic is missing: no offline unwind rate")
        return out
    big = unwind_bench.running_code_path()
    for key, call in (
        ("offline_samples_per_s", lambda: unwind_bench.offline_rate()),
        ("elf_load_big", lambda: {"path": str(big), **unwind_bench.load_time(big)}),
    ):
        try:
            out[key] = call()
        except Exception as err:  # a benchmark of a teammate's module: report, keep going
            log(f"offline: {key}: {type(err).__name__}: {err}")
    return out
