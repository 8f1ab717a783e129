"""The guest the benchmark samples: the bundled kernel booted under QEMU/TCG with QMP and a
gdbstub, and its progress counter (how much work the guest got done) read over QMP.

QEMU is started by the fixtures' own launcher, ``scripts/run-guest`` (which builds the fixtures
when they are missing and execs QEMU, so its pid is QEMU's).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from qmpprof.errors import ConnectError, QmpprofError, TransportError
from support.bench.rawqmp import RawQmp

_BOOT_TIMEOUT = 20.0
DEFAULT_PROGRESS_SYMBOL = "progress_counter"


@dataclass(frozen=True)
class Fixture:
    """The files of one guest variant."""

    kernel: Path
    progress_symbol: str

    @classmethod
    def find(cls, root: Path, variant: str) -> Fixture:
        kernel = root / "fixtures" / "build" / variant / "kernel.elf"
        symbol = DEFAULT_PROGRESS_SYMBOL
        expected = root / "fixtures" / "guest" / "expected.json"
        if expected.is_file():
            symbol = json.loads(expected.read_text()).get("progress_symbol", symbol)
        return cls(kernel, symbol)


@dataclass
class Guest:
    """A booted guest: the QMP socket the measured methods use, and a witness connection on a
    second socket of its own (QEMU serves one client per socket) that reads the guest's
    progress and opens and closes a gdbstub for the methods that need one."""

    proc: subprocess.Popen[bytes]
    qmp_path: str
    witness: RawQmp
    progress_addr: int
    smp: int = 1
    gdb_address: str = ""  # while a gdbstub is open

    def open_gdbstub(self) -> str:
        """Start a gdbstub on a free TCP port (HMP gdbserver); its address."""
        port = free_port()
        reply = self.witness.hmp(f"gdbserver tcp:127.0.0.1:{port}")
        if "Waiting for gdb connection" not in reply:
            raise QmpprofError(f"QEMU refused a gdbstub: {reply.strip()}")
        self.gdb_address = f"127.0.0.1:{port}"
        return self.gdb_address

    def close_gdbstub(self) -> None:
        """Remove the gdbstub (the guest's run state is left as it is)."""
        self.witness.hmp("gdbserver none")
        self.gdb_address = ""

    def progress(self) -> int:
        """The guest's progress counter (read while it runs: memsave does not stop it)."""
        value: int = struct.unpack("<Q", self.witness.memsave(self.progress_addr, 8))[0]
        return value

    async def read_progress(self) -> int:
        return self.progress()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def symbol_address(kernel: Path, name: str) -> int:
    """The address of a data symbol. qmpprof's symbol table keeps functions only, so ask nm."""
    listing = subprocess.run(
        ["nm", "-P", str(kernel)], capture_output=True, text=True, check=False
    ).stdout
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0] == name:
            return int(fields[2], 16)
    raise QmpprofError(f"{kernel}: no symbol {name!r} (the guest's progress counter)")


@contextlib.contextmanager
def boot(root: Path, fixture: Fixture, variant: str, smp: int = 1) -> Iterator[Guest]:
    """Boot the guest (no gdbstub: the default qmpprof path opens its own) and wait until its
    workload runs; always kill QEMU on the way out."""
    workdir = Path(tempfile.mkdtemp(prefix="qmpprof-bench-"))
    qmp_path, witness_path = str(workdir / "qmp.sock"), str(workdir / "witness.sock")
    cmd = [str(root / "scripts" / "run-guest"), "--variant", variant, "--smp", str(smp)]
    cmd += ["--qmp-socket", qmp_path, "--qmp-socket", witness_path]
    cmd += ["--console", str(workdir / "console")]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        guest = Guest(proc, qmp_path, _wait_for_qmp(proc, witness_path), 0, smp)
        try:
            guest.progress_addr = symbol_address(fixture.kernel, fixture.progress_symbol)
            _wait_for_progress(guest)
            yield guest
        finally:
            guest.witness.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_for_progress(guest: Guest) -> None:
    deadline = time.monotonic() + _BOOT_TIMEOUT
    while True:
        try:
            if guest.progress() > 0:
                return
        except TransportError:
            pass  # the kernel's page tables are not up yet: its address does not resolve
        if time.monotonic() > deadline:
            raise QmpprofError("the guest's workload did not start")
        time.sleep(0.05)


def _wait_for_qmp(proc: subprocess.Popen[bytes], path: str) -> RawQmp:
    deadline = time.monotonic() + _BOOT_TIMEOUT
    while True:
        try:
            return RawQmp(path)
        except ConnectError:
            if proc.poll() is not None:
                raise QmpprofError(f"QEMU exited at start ({proc.returncode})") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
