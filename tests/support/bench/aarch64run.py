"""qmpprof on the aarch64 test guest (tests/aarch64vm.py: bookworm's arm64 6.1 under
qemu-system-aarch64, KASLR on, 2 vCPUs, ``-cpu max``), as ``qmpprof --qmp-socket S --kernel
vmlinuz`` runs it: the median pause of a sample (``aarch64_pause_ms``, beside the x86_64 Linux
guest's ``linux_pause_ms``), its first pause and its truncated share."""

from __future__ import annotations

import gc
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from qmpprof.errors import QmpprofError
from qmpprof.sampler import SamplerConfig
from qmpprof.session import RunSpec, start
from qmpprof.transport.base import Reach
from support.bench.qmpprof_run import settle

INTERVAL = 0.010


async def aarch64_run(duration: float, log: Callable[[str], None]) -> dict[str, object]:
    """``duration`` seconds of guest run time sampled on the aarch64 guest."""
    empty: dict[str, object] = {"aarch64_pause_ms": None, "aarch64_first_pause_ms": None}
    try:
        from aarch64vm import image, running_aarch64_guest
    except ImportError as err:
        log(f"aarch64 run: {err}: not measured")
        return empty
    sampling = SamplerConfig(interval=INTERVAL, duration=duration)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with running_aarch64_guest(Path(tmp), "6.1", dump_kallsyms=False) as guest:
                spec = RunSpec(
                    reach=Reach(guest.qmp_socket), kernel=image("6.1"), sampling=sampling
                )
                run = await start(spec)
                try:
                    settle()
                    await run.run()
                finally:
                    gc.unfreeze()
                    await run.transport.close()
        except (QmpprofError, RuntimeError, TimeoutError) as err:
            log(f"aarch64 run: {err}")
            return empty
    ms = [p * 1e3 for p in run.stats.pauses]
    samples = len(run.profile)
    median = statistics.median(ms) if ms else None
    log(
        f"aarch64: {samples} samples, {run.profile.truncated} truncated, median pause"
        f" {median} ms, first {ms[0] if ms else None} ms"
    )
    return {
        "aarch64_pause_ms": median,
        "aarch64_first_pause_ms": ms[0] if ms else None,
        "aarch64_truncated_share": run.profile.truncated / samples if samples else None,
        "aarch64_samples": samples,
    }
