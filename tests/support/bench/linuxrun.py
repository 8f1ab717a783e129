"""qmpprof on the Linux test guest (tests/linuxvm.py: Debian's 6.12 with KASLR, 2 vCPUs, its
PIE workload and module), as ``qmpprof --qmp-socket S --kernel vmlinuz --user-dir rootfs``
runs it: the median pause of a sample, to hold against the bundled guest's
(``linux_pause_ms``; issue 11: at most 1.3x ``default_pause_ms_smp2``, the bundled guest on
2 vCPUs), the first pause, and the truncated share."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from qmpprof.errors import QmpprofError
from qmpprof.sampler import SamplerConfig
from qmpprof.session import RunSpec, start


async def linux_run(root: Path, duration: float, log: Callable[[str], None]) -> dict[str, object]:
    empty: dict[str, object] = {"linux_pause_ms": None, "linux_first_pause_ms": None}
    try:
        from linuxvm import ROOTFS, running_linux_guest
    except ImportError as err:
        log(f"linux run: {err}: not measured")
        return empty
    kernel = root / "fixtures" / "build" / "linux" / "vmlinuz"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with running_linux_guest(Path(tmp), kaslr=True, smp=2, dump_kallsyms=False) as guest:
                spec = RunSpec(
                    qmp_socket=guest.qmp_socket,
                    kernel=kernel,
                    user_dir=ROOTFS,
                    sampling=SamplerConfig(interval=0.010, duration=duration),
                )
                sampler = await start(spec)
                try:
                    await sampler.run()
                finally:
                    await sampler.transport.close()
        except (QmpprofError, RuntimeError, TimeoutError) as err:
            log(f"linux run: {err}")
            return empty
    pauses = [p * 1e3 for p in sampler.stats.pauses]
    samples, truncated = len(sampler.profile), sampler.profile.truncated
    log(
        f"linux: {samples} samples, {truncated} truncated, median pause"
        f" {statistics.median(pauses):.3f} ms, first {pauses[0]:.3f} ms"
    )
    return {
        "linux_pause_ms": statistics.median(pauses),
        "linux_first_pause_ms": pauses[0],
        "linux_truncated_share": truncated / samples if samples else None,
        "linux_samples": samples,
    }
