"""What a big guest costs a pause (issue 38): the Linux test guest with its ``qmpprof.big``
word (a process holding vm.max_map_count's 65,530 mappings, a module of 30,000 functions more,
the process running in both) beside the same kernel and workload without it, both booted at
once and sampled in turn at the default interval: the p95 pause on the big guest over the
p95 on the other (``big_guest_pause_ratio``, issue 38's target: at most 2).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path

from qmpprof.errors import QmpprofError
from qmpprof.sampler import SamplerConfig
from qmpprof.session import RunSpec
from qmpprof.transport.base import Reach
from support.bench.qmpprof_run import sampled

INTERVAL = 0.010  # the command line's default
BIG = "qmpprof.big"  # the kernel command-line word


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


async def linux_big(root: Path, duration: float, log: Callable[[str], None]) -> dict[str, object]:
    """Runs of ``duration`` seconds of guest run time on the plain, the big, the plain and the
    big guest (6.12, KASLR on, 2 vCPUs each); the p95 of each kind's pauses."""
    empty: dict[str, object] = {"big_guest_pause_ratio": None}
    try:
        from linuxvm import ROOTFS, running_linux_guest
    except ImportError as err:
        log(f"linux big: {err}: not measured")
        return empty
    kernel = root / "fixtures" / "build" / "linux" / "vmlinuz"
    pauses: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as guests:
        try:
            boots = {}
            for big in (False, True):
                folder = Path(tmp) / ("big" if big else "plain")
                folder.mkdir()
                boots[big] = guests.enter_context(
                    running_linux_guest(
                        folder, kaslr=True, smp=2, dump_kallsyms=False, append=BIG if big else ""
                    )
                )
            for big in (False, True, False, True):
                spec = RunSpec(
                    reach=Reach(qmp_socket=boots[big].qmp_socket),
                    kernel=kernel,
                    user_dir=ROOTFS,
                    sampling=SamplerConfig(interval=INTERVAL, duration=duration),
                )
                run = await sampled(spec)
                pauses[big] += run.stats.pauses
        except (QmpprofError, RuntimeError, TimeoutError) as err:
            log(f"linux big: {err}")
            return empty
    plain_ms, big_ms = (p95(pauses[kind]) * 1e3 for kind in (False, True))
    log(
        f"linux big: p95 pause {big_ms:.2f} ms with 65,530 mappings and 30,000 functions more,"
        f" {plain_ms:.2f} ms without ({len(pauses[True])} and {len(pauses[False])} ticks)"
    )
    return {
        "big_guest_pause_ratio": big_ms / plain_ms if plain_ms else None,
        "big_guest_pause_p95_ms": big_ms,
        "big_guest_reference_pause_p95_ms": plain_ms,
    }
