"""``scripts/bench --soak``: how qmpprof's memory grows with the number of samples.

The bundled guest boots with 2 vCPUs; ``qmpprof`` runs as a process of its own at a 2 ms
interval for a short run (3 000 samples) and a long one (30 000), writing folded stacks and a
saved profile, and its peak resident set size (``ru_maxrss`` from ``wait4``, that process only)
is recorded for each. A profile that kept a record per sample would grow by ~1 KB per sample;
one that interns its stacks grows by a few bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from support.bench.guest import Fixture, boot

SMP = 2
INTERVAL_MS = 2.0
COUNTS = (3000, 30000)


def run_qmpprof(argv: Sequence[str]) -> tuple[int, float, str]:
    """Run qmpprof; its exit status, peak RSS in MB, and stderr."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qmpprof", *argv], stdout=subprocess.DEVNULL, stderr=err
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return proc.returncode, usage.ru_maxrss / 1024, err.read()


def soak(
    root: Path, log: Callable[[str], None], counts: Sequence[int] = COUNTS
) -> dict[str, object]:
    fixture = Fixture.find(root, "cfi")
    user_dir = fixture.kernel.parent / "user"
    out: dict[str, object] = {"soak_smp": SMP, "soak_interval_ms": INTERVAL_MS}
    with boot(root, fixture, "cfi", smp=SMP) as guest, tempfile.TemporaryDirectory() as tmp:
        for count in counts:
            # Each tick samples every vCPU; the duration is guest run time.
            duration = count / SMP * INTERVAL_MS / 1e3
            argv = ["--qmp-socket", guest.qmp_path, "--kernel", str(fixture.kernel),
                    "--user-dir", str(user_dir), "--interval", str(INTERVAL_MS),
                    "--duration", f"{duration:g}", "-o", f"{tmp}/soak.folded",
                    "-o", f"{tmp}/soak.qmpprof"]  # fmt: skip
            started = time.monotonic()
            code, peak_mb, err = run_qmpprof(argv)
            if code != 0:
                raise RuntimeError(f"qmpprof exited {code}: {err.strip()}")
            samples = int(err.split("Samples: ", 1)[1].split()[0])
            log(f"soak: {samples} samples in {time.monotonic() - started:.0f} s,"
                f" peak RSS {peak_mb:.1f} MB")  # fmt: skip
            out[f"soak_rss_peak_mb_{count}"] = round(peak_mb, 1)
            out[f"soak_samples_{count}"] = samples
    low, high = (out[f"soak_rss_peak_mb_{c}"] for c in (counts[0], counts[-1]))
    assert isinstance(low, float) and isinstance(high, float)
    out["soak_rss_growth_mb"] = round(high - low, 1)
    return out
