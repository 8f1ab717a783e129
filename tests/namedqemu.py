"""A process that looks like QEMU to tests/qemumark.py (its command name is QEMU's) and is not:
a link to sleep, for checking the marker without booting anything."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def named_qemu(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process whose command name is QEMU's; killed on the way out."""
    program = tmp_path / "qemu-system-x86_64"
    program.symlink_to(shutil.which("sleep") or "/bin/sleep")
    proc = subprocess.Popen([str(program), "60"])
    # Popen may return before the kernel named the child after its new program (a vfork
    # parent resumes mid-exec): its command name says QEMU's only from then on.
    comm, deadline = Path(f"/proc/{proc.pid}/comm"), time.monotonic() + 10
    while not comm.read_text().startswith("qemu-system") and time.monotonic() < deadline:
        os.sched_yield()
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
