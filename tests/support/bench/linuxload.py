"""A stock Linux kernel image loaded as a run loads it, phase by phase: each run is a Python
process of its own (imports included), as a ``qmpprof --kernel vmlinuz`` is; cold (an empty
cache) and cached. The issue's budgets for the whole load (unpack, kallsyms, ORC index, BTF):
2 s cold, 0.3 s cached.

Imports are measured as an installed qmpprof imports: from compiled bytecode (pip compiles it
at install). The runs write theirs to a folder of the bench's own (``PYTHONPYCACHEPREFIX``),
filled by one run before any is measured, whatever ``PYTHONDONTWRITEBYTECODE`` says: without
it every run would compile qmpprof's sources again (100 ms and more of its imports).

``python -m support.bench.linuxload VMLINUZ`` prints one run's phases as JSON.
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import json  # noqa: E402 (the clock starts before the imports it measures)
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402


def phases(path: Path) -> dict[str, float]:
    """Milliseconds of each phase, in this (fresh) process: imports, the whole load as a run
    does it (unpack, kallsyms, ORC index, BTF; from the cache when it has them), the kernel's
    Module and the task and module layouts."""
    from qmpprof import arch
    from qmpprof.linux.kernel import LinuxKernel
    from qmpprof.linux.running.guest import Layouts
    from qmpprof.linux.running.image import kernel_module
    from qmpprof.linux.x86_64.running import X86_64

    marks = {"imports": time.perf_counter()}
    kernel = LinuxKernel.load(path).prepare()
    marks["load"] = time.perf_counter()
    kernel_module(kernel, 0, arch.by_name("x86_64"), X86_64)
    assert kernel.btf is not None
    Layouts.of(kernel)
    marks["module_and_layouts"] = time.perf_counter()
    out, before = {}, _START
    for name, mark in marks.items():
        out[name] = (mark - before) * 1e3
        before = mark
    out["total"] = (before - _START) * 1e3
    return out


def _runs(
    path: Path, cache: str, repeat: int, log: Callable[[str], None], bytecode: str
) -> list[dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env |= {"QMPPROF_CACHE_DIR": cache, "PYTHONPYCACHEPREFIX": bytecode}
    runs = []
    for _ in range(repeat):
        done = subprocess.run(
            [sys.executable, "-m", "support.bench.linuxload", str(path)],
            capture_output=True,
            text=True,
            check=False,
            env=env,
        )
        if done.returncode != 0:
            log(f"linux load: {done.stderr.strip().splitlines()[-1:]}")
            return []
        runs.append(json.loads(done.stdout))
    return runs


def linux_load(path: Path, log: Callable[[str], None], repeat: int = 3) -> dict[str, object]:
    """``linux_load_ms`` (cold: an empty cache each run) and ``linux_load_cached_ms`` (the
    cache filled by an earlier run): the median of each phase over ``repeat`` runs, or None
    without the image (scripts/fetch-linux brings it). Budgets: 2 s cold, 0.3 s cached."""
    if not path.exists():
        log(f"linux load: {path} is missing (scripts/fetch-linux): not measured")
        return {"linux_load_ms": None, "linux_load_cached_ms": None}
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as warm, tempfile.TemporaryDirectory() as bytecode:
        _runs(path, warm, 1, log, bytecode)  # fills the cache, and the bytecode's
        cold = [
            r
            for _ in range(repeat)
            for r in _runs(path, tempfile.mkdtemp(dir=warm), 1, log, bytecode)
        ]
        cached = _runs(path, warm, repeat, log, bytecode)
    for key, runs in (("linux_load_ms", cold), ("linux_load_cached_ms", cached)):
        out[key] = {k: statistics.median(r[k] for r in runs) for k in runs[0]} if runs else None
    return out


if __name__ == "__main__":
    print(json.dumps(phases(Path(sys.argv[1]))))
