"""Run the teaching-kernel-shaped guest (fixtures/hobby) under qemu-system-i386 for tests.

``running_hobby`` boots it on SMP (two) vCPUs with a QMP socket (and a gdbstub on ``gdb_port``
for the oracle), waits until every CPU and every user program said it runs, and kills QEMU
whatever happens. The guest is a ``Guest`` of tests/guestvm.py (variant ``hobby``), so its
oracles (gdb_backtrace, ...) apply.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from guestvm import (
    BOOT_TIMEOUT,
    BUILD_ROOT,
    Guest,
    _die_with_parent,
    _wait_qmp,
    build_fixtures,
    wait_console,
)

BUILD_DIR = BUILD_ROOT / "hobby"
SMP = 2
# What the kernel prints once every CPU runs (fixtures/hobby/main.c), and each user program
# once it runs (fixtures/hobby/user/*.c).
RUNNING_LINES = (f"hobby: scheduler running on {SMP} cpus", "crunch: running", "chatter: running")


@contextlib.contextmanager
def running_hobby(tmp_path: Path, *, gdb_port: int | None = None) -> Iterator[Guest]:
    """Boot the hobby guest on the ``qemu-system-i386`` first on PATH, on SMP vCPUs, and yield
    it once QMP accepts connections, every CPU runs and its programs run."""
    build_fixtures(("hobby",))
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    sock_dir = Path(tempfile.mkdtemp(prefix="qh-", dir="/tmp"))
    console = tmp_path / f"console-hobby-{time.monotonic_ns()}.txt"
    cmd = [
        "qemu-system-i386", "-kernel", str(BUILD_DIR / "kernel.elf"),
        "-accel", "tcg", "-smp", str(SMP), "-m", "64M",
        "-display", "none", "-no-reboot", "-monitor", "none",
        "-qmp", f"unix:{sock_dir / 'qmp.sock'},server=on,wait=off",
        "-serial", f"file:{console}",
    ]  # fmt: skip
    if gdb_port is not None:
        cmd += ["-gdb", f"tcp:127.0.0.1:{gdb_port}"]
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    guest = Guest(
        qmp_socket=sock_dir / "qmp.sock",
        console=console,
        variant="hobby",
        smp=SMP,
        build_dir=BUILD_DIR,
        process=process,
        gdb_port=gdb_port,
    )
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT
        _wait_qmp(guest, deadline)
        for line in RUNNING_LINES:
            wait_console(guest, line, max(deadline - time.monotonic(), 0.1))
        yield guest
    finally:
        process.kill()
        process.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(console)
