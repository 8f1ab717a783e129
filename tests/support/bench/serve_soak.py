"""``scripts/bench --serve-soak [SECONDS]``: ``qmpprof serve`` on a fleet for a long while.

Four Linux test guests boot (tests/linuxvm.py, 1 vCPU each), two on Debian's 6.12 and two on
6.1; ``qmpprof serve`` follows them from one ``--config`` TOML file (each VM its socket, its
kernel and the guest's root filesystem) at every default: the 50 ms interval, the overhead
budget of 1 %, the window. A scraper plays the clients it is made for: /metrics every SCRAPE
seconds, each VM's /flamegraph.svg for the last 30 s, and each VM's pprof endpoint
(``seconds=5``) once a minute. The serve process's resident set size (VmRSS) is read at
WARMUP seconds (start: modules imported, kernels loaded, every VM sampled), every minute
after, and at the end; its peak (``ru_maxrss`` from ``wait4``) after SIGTERM, which must end
it with status 0. Per VM, from serve's own /metrics: samples, errors, truncated (and of them,
stopped in kernel code), mean pause, the share of the wall time stopped (its pauses over the
time it was sampled) and the interval in force.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from qmpprof.errors import QmpprofError

WARMUP = 30.0  # seconds before the first RSS reading
SCRAPE = 10.0  # seconds between scrapes
PPROF_EVERY = 60.0
FLEET = (("a612", "6.12"), ("b612", "6.12"), ("c61", "6.1"), ("d61", "6.1"))  # VM, kernel
NAMES = tuple(name for name, _ in FLEET)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise QmpprofError(f"no VmRSS for process {pid}")


def fetch(url: str, timeout: float = 30.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        body: bytes = answer.read()
        return body


def metric(text: str, name: str, vm: str, extra: str = "") -> float:
    found = re.search(rf'^{name}{{vm="{vm}"{extra}}} (\S+)$', text, re.MULTILINE)
    if found is None:
        raise QmpprofError(f"/metrics has no {name} for {vm}")
    return float(found[1])


def _scrape(url: str, last_pprof: float, log: Callable[[str], None]) -> float:
    fetch(url + "metrics")
    for vm in NAMES:
        fetch(f"{url}flamegraph.svg?vm={vm}&seconds=30")
    if time.monotonic() - last_pprof >= PPROF_EVERY:
        for vm in NAMES:
            size = len(fetch(f"{url}debug/pprof/profile?vm={vm}&seconds=5"))
            log(f"serve-soak: pprof of {vm}: {size} bytes")
        return time.monotonic()
    return last_pprof


def serve_soak(root: Path, seconds: float, log: Callable[[str], None]) -> dict[str, object]:
    from guestvm import run_state
    from linuxkernel import linux_dir
    from linuxvm import ROOTFS, running_linux_guest

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serve-soak-")))
        guests, tables = [], []
        for name, series in FLEET:
            kernel = linux_dir(series) / "vmlinuz"
            guest = stack.enter_context(
                running_linux_guest(tmp, smp=1, kernel=kernel, dump_kallsyms=False)
            )
            guests.append(guest)
            tables.append(
                f'[vm.{name}]\nsocket = "{guest.qmp_socket}"\nkernel = "{kernel}"\n'
                f'user_dir = "{ROOTFS}"\n'
            )
            log(f"serve-soak: {name} booted Linux {series} in {guest.boot_seconds:.0f} s")
        config = tmp / "fleet.toml"
        config.write_text("\n".join(tables))
        argv = [sys.executable, "-m", "qmpprof", "serve", "--listen", "127.0.0.1:0",
                "--config", str(config)]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            out = _soak(proc, seconds, log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for guest in guests:
            if run_state(guest.qmp_socket) != "running":
                raise QmpprofError(f"{guest.qmp_socket}: the guest was not running after serve")
    return out


def _soak(
    proc: subprocess.Popen[str], seconds: float, log: Callable[[str], None]
) -> dict[str, object]:
    assert proc.stderr is not None
    line = proc.stderr.readline()
    found = re.search(r"http://\S+/", line)
    if found is None:
        raise QmpprofError(f"serve did not start: {line.strip()}")
    url = found[0]
    started = time.monotonic()
    time.sleep(WARMUP)
    rss_start = rss_mb(proc.pid)
    log(f"serve-soak: {url} RSS {rss_start:.1f} MB after {WARMUP:g} s; {seconds:g} s to go")
    last_pprof = time.monotonic() - PPROF_EVERY  # one right away
    end = started + WARMUP + seconds
    per_minute: list[float] = []  # RSS a minute apart: does it level off once the window is full?
    while time.monotonic() < end:
        last_pprof = _scrape(url, last_pprof, log)
        if time.monotonic() - started - WARMUP >= 60 * (len(per_minute) + 1):
            per_minute.append(round(rss_mb(proc.pid), 1))
            log(f"serve-soak: RSS {per_minute[-1]:.1f} MB after {len(per_minute)} min")
        time.sleep(max(0.0, min(SCRAPE, end - time.monotonic())))
    text = fetch(url + "metrics").decode()
    rss_end = rss_mb(proc.pid)
    elapsed = time.monotonic() - started
    proc.send_signal(signal.SIGTERM)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise QmpprofError(f"serve exited {proc.returncode} on SIGTERM: {proc.stderr.read()}")
    out: dict[str, object] = {
        "serve_soak_seconds": round(elapsed),
        "serve_rss_start_mb": round(rss_start, 1),
        "serve_rss_end_mb": round(rss_end, 1),
        "serve_rss_peak_mb": round(usage.ru_maxrss / 1024, 1),
        "serve_rss_growth_mb": round(rss_end - rss_start, 1),
        "serve_rss_mb_per_minute": per_minute,
    }
    for vm in NAMES:
        samples = metric(text, "qmpprof_samples_total", vm)
        count = metric(text, "qmpprof_pause_seconds_count", vm)
        stopped = metric(text, "qmpprof_pause_seconds_sum", vm)
        out[f"serve_{vm}_samples"] = int(samples)
        out[f"serve_{vm}_rate_hz"] = round(count / elapsed, 2)
        out[f"serve_{vm}_errors"] = int(metric(text, "qmpprof_errors_total", vm))
        out[f"serve_{vm}_truncated"] = int(metric(text, "qmpprof_truncated_total", vm))
        out[f"serve_{vm}_truncated_in_kernel"] = int(
            metric(text, "qmpprof_truncated_in_kernel_total", vm)
        )
        out[f"serve_{vm}_mean_pause_ms"] = round(stopped / max(count, 1) * 1e3, 2)
        sampled = metric(text, "qmpprof_sampled_seconds_total", vm)
        out[f"serve_{vm}_stopped_share"] = round(stopped / sampled, 4) if sampled else None
        out[f"serve_{vm}_interval_ms"] = round(metric(text, "qmpprof_interval_seconds", vm) * 1e3)
    log(f"serve-soak: RSS {rss_start:.1f} -> {rss_end:.1f} MB in {elapsed:.0f} s")
    return out
