"""Run the riscv64 test guest (trixie's riscv64 kernel + fixtures/riscv64-guest) under
qemu-system-riscv64 for tests.

``running_riscv64_guest`` boots it through scripts/run-riscv64-guest, waits for the workload line
on the console and kills QEMU afterwards, whatever happens. The kernel has no KASLR
(CONFIG_RANDOMIZE_BASE off in its config): its -dbg vmlinux's addresses are the running ones.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from guestvm import _check_alive, _die_with_parent, _wait_qmp

ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = ROOT / "fixtures" / "build" / "linux-riscv64"
ROOTFS = ROOT / "fixtures" / "build" / "riscv64-guest" / "rootfs"
WORKLOAD_LINE = "qmpprof-riscv64: workload running"
# 25-35 s on this loaded 2-core machine with the kallsyms dump left out (the dump, 1 MB of
# base64 through the UART, takes 100 s more): a guard against a hung boot.
BOOT_TIMEOUT = 300.0


@dataclass
class Riscv64Guest:
    """One running qemu-system-riscv64 with the riscv64 test guest."""

    qmp_socket: Path
    console: Path
    process: subprocess.Popen[bytes]
    boot_seconds: float = 0.0

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""


def vmlinux_dbg() -> Path:
    """The kernel's -dbg vmlinux (DWARF, .symtab): the ELF of the Image the guest boots."""
    return KERNEL_DIR / "vmlinux-dbg"


@contextlib.contextmanager
def running_riscv64_guest(
    tmp_path: Path, *, smp: int = 2, gdb_port: int | None = None, append: str = ""
) -> Iterator[Riscv64Guest]:
    """Boot the guest on ``smp`` vCPUs and yield it once the workload runs; ``gdb_port``:
    QEMU's gdbstub there; ``append``: more of the kernel's command line."""
    sock_dir = Path(tempfile.mkdtemp(prefix="rv64-", dir="/tmp"))  # short Unix socket paths
    guest = Riscv64Guest(
        qmp_socket=sock_dir / "qmp.sock",
        console=tmp_path / "riscv64-console.txt",
        process=None,  # type: ignore[arg-type]  # set right below
    )
    cmd = [
        str(ROOT / "scripts" / "run-riscv64-guest"),
        "--qmp-socket", str(guest.qmp_socket),
        "--console", str(guest.console),
        "--smp", str(smp),
        "--append", f"qmpprof.nokallsyms {append}".strip(),
    ]  # fmt: skip
    if gdb_port is not None:
        cmd += ["--gdb", str(gdb_port)]
    start = time.monotonic()
    guest.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    try:
        deadline = start + BOOT_TIMEOUT
        _wait_qmp(guest, deadline)
        while WORKLOAD_LINE not in guest.console_text():
            _check_alive(guest)
            if time.monotonic() > deadline:
                raise TimeoutError(f"console never showed the workload:\n{guest.console_text()}")
            time.sleep(0.05)
        guest.boot_seconds = time.monotonic() - start
        yield guest
    finally:
        guest.process.kill()  # run-riscv64-guest execs QEMU: this is QEMU's pid
        guest.process.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)
