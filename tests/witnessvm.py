"""The bundled guest with a witness: a second QMP socket that watches the run state, the
chardevs and the guest's progress while qmpprof holds the first (QEMU serves one client per
socket)."""

from __future__ import annotations

import contextlib
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import qemumark
from guestvm import BUILD_ROOT, WORKLOAD_LINE, Guest, build_fixtures, free_tcp_port, wait_console
from support.bench.rawqmp import RawQmp

from qmpprof.errors import ConnectError

PROGRESS = "progress_counter"
WINDOW = 16 * 1024


@dataclass
class Vm:
    guest: Guest
    witness: RawQmp
    qmp_tcp: int | None
    more: tuple[str, ...] = ()  # further QMP sockets (``more_sockets``)

    @property
    def socket(self) -> str:
        return str(self.guest.qmp_socket)

    def chardevs(self) -> list[str]:
        return [c["label"] for c in self.witness.execute("query-chardev")]

    def stub(self) -> str:
        """query-chardev's filename of the gdbstub (the chardev labelled ``gdb``)."""
        (found,) = [c for c in self.witness.execute("query-chardev") if c["label"] == "gdb"]
        filename: str = found["filename"]
        return filename

    def progress(self) -> int:
        addr = symbol(self.guest.kernel_elf, PROGRESS)
        value: int = struct.unpack("<Q", self.witness.memsave(addr, 8))[0]
        return value

    def advances(self) -> bool:
        """Whether the guest gets work done within a while (it runs)."""
        first = self.progress()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if self.progress() != first:
                return True
        return False


def symbol(elf: Path, name: str) -> int:
    out = subprocess.run(["nm", "-P", str(elf)], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        fields = line.split()
        if fields and fields[0] == name:
            return int(fields[2], 16)
    raise AssertionError(f"no {name} in {elf}")


@contextlib.contextmanager
def vm(
    tmp_path: Path,
    smp: int = 2,
    *,
    paused: bool = False,
    gdb_port: int | None = None,
    qmp_tcp: bool = False,
    more_sockets: int = 0,
) -> Iterator[Vm]:
    """The cfi guest as scripts/run-guest starts it, plus a witness QMP socket (and optionally
    ``-gdb``, a QMP TCP port, ``more_sockets`` QMP sockets); ``paused``: stopped by the witness
    once the workload runs."""
    qemumark.booting("witnessvm.vm")
    build_fixtures()
    sock_dir = Path(tempfile.mkdtemp(prefix="qg-pg-", dir="/tmp"))  # short socket paths
    console = tmp_path / "console.txt"
    build = BUILD_ROOT / "cfi"
    cmd = ["qemu-system-x86_64", "-kernel", str(build / "kernel.elf"), "-accel", "tcg",
           "-smp", str(smp), "-m", "128M", "-display", "none", "-no-reboot", "-monitor", "none",
           "-serial", f"file:{console}",
           "-qmp", f"unix:{sock_dir / 'qmp.sock'},server=on,wait=off",
           "-qmp", f"unix:{sock_dir / 'witness.sock'},server=on,wait=off"]  # fmt: skip
    if gdb_port is not None:
        cmd += ["-gdb", f"tcp:127.0.0.1:{gdb_port}"]
    tcp_port = free_tcp_port() if qmp_tcp else None
    if tcp_port is not None:
        cmd += ["-qmp", f"tcp:127.0.0.1:{tcp_port},server=on,wait=off"]
    more = tuple(str(sock_dir / f"qmp{i + 2}.sock") for i in range(more_sockets))
    for path in more:
        cmd += ["-qmp", f"unix:{path},server=on,wait=off"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    guest = Guest(sock_dir / "qmp.sock", console, "cfi", smp, build, proc, gdb_port)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                witness = RawQmp(str(sock_dir / "witness.sock"))
                break
            except ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, "QEMU did not start"
                time.sleep(0.02)
        with witness:
            wait_console(guest, WORKLOAD_LINE)
            if paused:
                witness.execute("stop")
            yield Vm(guest, witness, tcp_port, more)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)
