"""What ``--off-cpu`` costs a pause on the Linux test guest with hundreds of tasks (its
``qmpprof.sleepers`` word: 200 sleeping tasks more): the median pause of a run with the flag
over that of a run without, sampled in turn on one boot (``offcpu_pause_ratio``, issue 21's
target: at most 1.5). The tasks are looked at while the guest runs; the pause reads what it
reads without the flag.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from qmpprof.errors import QmpprofError
from qmpprof.sampler import SamplerConfig
from qmpprof.session import RunSpec
from qmpprof.transport.base import Reach
from support.bench.qmpprof_run import sampled

INTERVAL = 0.010
SLEEPERS = "qmpprof.sleepers"  # the kernel command-line word
STARTED = "qmpprof-linux: sleepers started"
START_TIMEOUT = 120.0


async def linux_offcpu(
    root: Path, duration: float, log: Callable[[str], None]
) -> dict[str, object]:
    """Runs of ``duration`` seconds of guest run time without, with, without and with
    ``--off-cpu`` on the 2-vCPU guest (KASLR on); the medians of each kind's pauses."""
    empty: dict[str, object] = {"offcpu_pause_ratio": None}
    try:
        from linuxvm import ROOTFS, running_linux_guest, wait_console
    except ImportError as err:
        log(f"linux off-cpu: {err}: not measured")
        return empty
    kernel = root / "fixtures" / "build" / "linux" / "vmlinuz"
    pauses: dict[bool, list[float]] = {False: [], True: []}
    tasks = 0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with running_linux_guest(
                Path(tmp), kaslr=True, smp=2, dump_kallsyms=False, append=SLEEPERS
            ) as guest:
                wait_console(guest, STARTED, START_TIMEOUT)
                for off_cpu in (False, True, False, True):
                    spec = RunSpec(
                        reach=Reach(guest.qmp_socket),
                        kernel=kernel,
                        user_dir=ROOTFS,
                        off_cpu=off_cpu,
                        sampling=SamplerConfig(interval=INTERVAL, duration=duration),
                    )
                    run = await sampled(spec)
                    pauses[off_cpu] += run.stats.pauses
                    waiting = {r.process for r in run.profile.stacks if r.state is not None}
                    tasks = max(tasks, len(waiting))
        except (QmpprofError, RuntimeError, TimeoutError) as err:
            log(f"linux off-cpu: {err}")
            return empty
    without, with_flag = (statistics.median(pauses[flag]) * 1e3 for flag in (False, True))
    log(
        f"linux off-cpu: median pause {with_flag:.2f} ms with --off-cpu, {without:.2f} ms"
        f" without ({len(pauses[True])} and {len(pauses[False])} ticks); {tasks} tasks off CPU"
    )
    return {
        "offcpu_pause_ratio": with_flag / without if without else None,
        "offcpu_pause_ms": with_flag,
        "offcpu_reference_pause_ms": without,
        "offcpu_tasks": tasks,
    }
