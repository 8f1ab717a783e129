"""The command's start-up: the CPU time of ``qmpprof --help`` in a new interpreter (every
module a run of the command imports before it parses its flags), against ``python -c pass``
(what any Python program pays), the two in turn, ``REPEAT`` times each: ``startup_ms``,
``startup_python_ms`` and their ratio, ``startup_ratio``, from the same run of the bench.

CPU time (the child's user and system time) moves less than wall time with the host's load.
Imports are measured as an installed qmpprof imports: from compiled bytecode, in a folder of the
bench's own (``PYTHONPYCACHEPREFIX``), filled by one run before any is measured
(``linuxload.py`` does the same).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPEAT = 7


def cpu_ms(argv: list[str], env: dict[str, str]) -> float:
    """Milliseconds of CPU (user and system) the process ``argv`` took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return used * 1e3


def summary(command_ms: list[float], python_ms: list[float]) -> dict[str, float]:
    """The medians of the two, and the command's over Python's."""
    command, python = statistics.median(command_ms), statistics.median(python_ms)
    return {
        "startup_ms": round(command, 1),
        "startup_python_ms": round(python, 1),
        "startup_ratio": round(command / python, 2),
    }


def startup(root: Path, log: Callable[[str], None], repeat: int = REPEAT) -> dict[str, float]:
    """``summary`` of ``repeat`` runs of each, the tree at ``root`` being the qmpprof run."""
    with tempfile.TemporaryDirectory(prefix="bench-pyc-") as bytecode:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env |= {"PYTHONPATH": str(root), "PYTHONPYCACHEPREFIX": bytecode}
        command = [sys.executable, "-m", "qmpprof", "--help"]
        python = [sys.executable, "-c", "pass"]
        cpu_ms(command, env)  # compiles the bytecode the measured runs import
        command_ms, python_ms = [], []
        for _ in range(repeat):
            command_ms.append(cpu_ms(command, env))
            python_ms.append(cpu_ms(python, env))
    found = summary(command_ms, python_ms)
    log(f"start-up: qmpprof --help {found['startup_ms']} ms of CPU, python -c pass "
        f"{found['startup_python_ms']} ms ({found['startup_ratio']}x)")  # fmt: skip
    return found


if __name__ == "__main__":
    print(startup(Path(__file__).resolve().parents[3], print))
