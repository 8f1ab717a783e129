"""Issue 36: whether a sample costs the same at every rate, on the bundled guest.

- ``pause_interval_ratio``: qmpprof's default path samples at a 10 ms and at a 1 s interval in
  turn (``ROUNDS`` times each, the host being shared), over one connection: ``pause_10ms_ms``
  and ``pause_1s_ms`` (median pauses), the second over the first. A stretch is one run of the
  sampler, and the first pause of each is left out of both (a run's first pause is
  ``first_pause_ratio``'s).
- ``serve_pause_ratio``: ``qmpprof serve`` at its defaults (its command line parsed, no flags but
  the socket) follows the same guest for ``SERVE_SECONDS``, in a thread as serve does, between
  the stretches: ``serve_pause_ms`` (its median pause) over ``pause_10ms_ms``.
- ``default_pause_ratio`` (the default path over the bare gdbstub loop, the faster of its
  ``gdbstub`` and ``gdbstub-fused`` ways) and
  ``first_pause_ratio`` (a fresh run's first pause over the default path's median): ratios of
  keys the bench measures elsewhere in the same run (``ratios``).
- ``host_touch_ratio``: the host's share, with no QEMU in it: the time this process takes to
  write one byte in each page of ``TOUCH_BYTES`` of its own memory after sleeping 1 s, over the
  same after sleeping 10 ms (``host_touch_1s_ms``, ``host_touch_10ms_ms``). A sample's pause
  touches memory qmpprof, QEMU and the socket layers last touched one interval before: where
  the host makes memory untouched for a second slow to touch again (measured 20x on this
  project's host, docs/bench.md), every pause at a long interval pays it, whatever the
  sampler does, and ``pause_interval_ratio`` is read against this.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qmpprof.cli import serve as serve_cli
from qmpprof.serve.vm import Vm, in_thread
from qmpprof.transport import Reach
from support.bench.guest import Fixture, Guest
from support.bench.qmpprof_run import QmpprofSampler

ROUNDS = 3
SHORT, LONG = 0.010, 1.0
_SHORT_SECONDS, _LONG_SECONDS = 0.5, 5.0  # per stretch: ~40 and ~5 samples
SERVE_SECONDS = 10.0  # its budget may stretch the interval to seconds: a few ticks, at least
_WINDOW = 60  # seconds serve's ring keeps: all of a round's
TOUCH_BYTES = 8 << 20  # of this process's memory, written a byte a page (2,048 pages)
_TOUCHES = 6  # per interval, the two in turn
_PAGE = 4096


async def pause_intervals(
    guest: Guest, fixture: Fixture, log: Callable[[str], None]
) -> dict[str, Any]:
    """The medians and their ratios, the guest running."""
    user_dir = fixture.kernel.parent / "user"
    sampler = QmpprofSampler("qmpprof-default", fixture.kernel, user_dir, qmp=guest.qmp_path)
    pauses: dict[float, list[float]] = {SHORT: [], LONG: []}
    served: list[float] = []
    await sampler.setup()
    try:
        for _ in range(ROUNDS):
            for interval, seconds in ((SHORT, _SHORT_SECONDS), (LONG, _LONG_SECONDS)):
                paced = await sampler.run(interval, seconds)
                pauses[interval] += [p * 1e3 for p in paced.pauses[1:]]
    finally:
        await sampler.teardown()
    served = await serve_pauses(guest.qmp_path, fixture.kernel, SERVE_SECONDS)
    found = summary(pauses[SHORT], pauses[LONG], served)
    found.update(host_touch(host_touches()))
    log(
        f"pause by interval: {found['pause_10ms_ms']} ms at 10 ms ({len(pauses[SHORT])}), "
        f"{found['pause_1s_ms']} ms at 1 s ({len(pauses[LONG])}), serve "
        f"{found['serve_pause_ms']} ms ({len(served)}): {found['pause_interval_ratio']}x, "
        f"serve {found['serve_pause_ratio']}x; the host re-touching memory idle 1 s: "
        f"{found['host_touch_1s_ms']} ms vs 10 ms: {found['host_touch_10ms_ms']} ms "
        f"({found['host_touch_ratio']}x)"
    )
    return found


def host_touches() -> dict[float, list[float]]:
    """Milliseconds to write a byte in each page of TOUCH_BYTES of this process's memory,
    after sleeping each interval (the guest runs on, untouched by this)."""
    memory = bytearray(TOUCH_BYTES)
    found: dict[float, list[float]] = {SHORT: [], LONG: []}
    for _ in range(_TOUCHES):
        for interval in (SHORT, LONG):
            time.sleep(interval)
            start = time.perf_counter()
            for at in range(0, TOUCH_BYTES, _PAGE):
                memory[at] += 1
            found[interval].append((time.perf_counter() - start) * 1e3)
    return found


def host_touch(touches: dict[float, list[float]]) -> dict[str, Any]:
    """The medians of ``host_touches`` and the 1 s one over the 10 ms one."""
    short, long = _median(touches[SHORT]), _median(touches[LONG])
    return {
        "host_touch_10ms_ms": short,
        "host_touch_1s_ms": long,
        "host_touch_ratio": _ratio(long, short),
    }


async def serve_pauses(qmp_path: str, kernel: Path, seconds: float) -> list[float]:
    """Every pause (ms) of ``qmpprof serve`` at its defaults following the guest at
    ``qmp_path`` for ``seconds``, its VM in a thread of its own as serve runs it."""
    argv = ["--kernel", str(kernel), "--user-dir", str(kernel.parent / "user")]
    config = serve_cli.parse([*argv, "--qmp-socket", qmp_path])
    vm = Vm("bench", Reach(Path(qmp_path)), config.spec, _WINDOW)
    done = in_thread(vm)
    try:
        await asyncio.sleep(seconds)
    finally:
        vm.stop()
        await done
    return [p * 1e3 for second in vm.ring.last(_WINDOW) for p in second.pauses]


def summary(short_ms: list[float], long_ms: list[float], serve_ms: list[float]) -> dict[str, Any]:
    """The median pause at each interval and serve's, and theirs over the short one's (None
    where a side has no pause)."""
    short, long, serve = (_median(v) for v in (short_ms, long_ms, serve_ms))
    return {
        "pause_10ms_ms": short,
        "pause_1s_ms": long,
        "serve_pause_ms": serve,
        "pause_interval_ratio": _ratio(long, short),
        "serve_pause_ratio": _ratio(serve, short),
    }


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    """Ratios of pauses the bench measured in this run."""
    default, first = result.get("default_pause_ms"), result.get("first_pause_ms")
    return {
        "default_pause_ratio": _ratio(default, _floor(result)),
        "first_pause_ratio": _ratio(first, default),
    }


def _floor(result: dict[str, Any]) -> float | None:
    """The bare gdbstub loop's pause: the faster of its two ways, the stop and the register
    read in turn (``gdbstub``) or in one write (``gdbstub-fused``, as qmpprof sends them)."""
    found = [result.get(key) for key in ("gdbstub_pause_ms", "gdbstub_fused_pause_ms")]
    return min((f for f in found if isinstance(f, float)), default=None)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _ratio(top: object, bottom: object) -> float | None:
    if isinstance(top, float) and isinstance(bottom, float) and bottom > 0:
        return round(top / bottom, 2)
    return None
