"""Run the Linux test guest (Debian's kernel + fixtures/linux-guest) under QEMU for tests.

``running_linux_guest`` boots it through scripts/run-linux-guest, waits for the workload line on
the console, reads the guest's own /proc/kallsyms (which init copied into reserved RAM) over QMP
and kills QEMU
afterwards, whatever happens. Any kernel scripts/fetch-linux fetched boots with the same
initramfs (``kernel=linux_dir(series) / "vmlinuz"``), the test module built for each.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import qemumark
from guestvm import _check_alive, _die_with_parent, _wait_qmp
from support.bench.rawqmp import RawQmp

from qmpprof.linux.symbols import KernelSymbols, parse_symbol_map

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "fixtures" / "build" / "linux-guest"
ROOTFS = BUILD / "rootfs"
WORK_ELF = ROOTFS / "bin" / "qmpprof-work"
MODULE_KO = BUILD / "module" / "qmpprof_burn.ko"
MODULE = "qmpprof_burn"
LIBC = ROOTFS / "lib" / "x86_64-linux-gnu" / "libc.so.6"
LDSO = ROOTFS / "lib64" / "ld-linux-x86-64.so.2"
XZ = ROOTFS / "usr" / "bin" / "xz"  # Debian's (bookworm), PIE; its work is done in liblzma
LIBLZMA = ROOTFS / "lib" / "x86_64-linux-gnu" / "liblzma.so.5"  # a symlink, as packaged
WORKLOAD_LINE = "qmpprof-linux: workload running"
KALLSYMS_END = "qmpprof-linux: kallsyms end"
MAPS_END = "qmpprof-linux: maps end"
CHURN = "qmpprof.churn"  # the kernel command-line word of the churn workload
# 5-10 s on an idle 2-core machine, 20-35 s at load average 12, once over 120 s
# (docs/linux-guest.md): a guard against a hung boot, not a speed check.
BOOT_TIMEOUT = 300.0

_build_lock = threading.Lock()
_built: set[tuple[str, ...]] = set()


def module_ko(release: str) -> Path:
    """The test module built for a kernel release, as /init finds it in the guest."""
    return ROOTFS / "lib" / "modules" / release / "qmpprof_burn.ko"


def build_linux_guest() -> None:
    """Run scripts/build-linux-guest once per test session (it skips an up-to-date build), and
    again when the session fetched another kernel meanwhile (it builds the module for each)."""
    fetched = tuple(sorted(p.read_text() for p in BUILD.parent.glob("linux*/version")))
    with _build_lock:
        if fetched not in _built:
            subprocess.run(
                [ROOT / "scripts" / "build-linux-guest"], check=True, stdin=subprocess.DEVNULL
            )
            _built.add(fetched)


@dataclass(frozen=True, slots=True)
class Mapping:
    """One line of a /proc/PID/maps."""

    start: int
    end: int
    perms: str
    offset: int
    path: str  # "" for anonymous memory


@dataclass(frozen=True, slots=True)
class ChurnRate:
    """One of the churn workload's reports: processes started in guest seconds."""

    processes: int
    seconds: float


@dataclass
class LinuxGuest:
    """One running QEMU with the Linux test guest."""

    qmp_socket: Path
    console: Path
    kallsyms: Path  # the guest's /proc/kallsyms, read once the workload runs
    kaslr: bool
    smp: int
    process: subprocess.Popen[bytes]
    gdb_port: int | None
    boot_seconds: float = 0.0  # from QEMU's start to the workload line
    witness_socket: Path | None = None  # a second QMP socket (``witness``)
    go_socket: Path | None = None  # COM3, where ``send_go`` writes (``go``)

    def send_go(self) -> None:
        """Write the line init's ``qmpprof.late_module`` waits on before it loads the module."""
        assert self.go_socket is not None, "booted without go=True"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as go:
            go.connect(str(self.go_socket))
            go.sendall(b"go\n")

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""

    @property
    def text_address(self) -> int:
        """The running kernel's ``_text``, as init printed it on the console."""
        match = re.search(r"^qmpprof-linux: ([0-9a-f]{16}) T _text\r?$", self.console_text(), re.M)
        if match is None:
            raise RuntimeError(f"{self.console}: no _text line")
        return int(match.group(1), 16)

    @property
    def module_address(self) -> int:
        """Where the test module's core is loaded, from /proc/modules as init printed it."""
        match = re.search(
            rf"^qmpprof-linux: module {MODULE} .* (0x[0-9a-f]+)", self.console_text(), re.M
        )
        if match is None:
            raise RuntimeError(f"{self.console}: no module line")
        return int(match.group(1), 16)

    def xz_maps(self) -> tuple[int, list[Mapping]]:
        """The pid of the guest's long-lived xz and its /proc/PID/maps, as /init printed them
        (once, before the workload line)."""
        text = self.console_text()
        match = re.search(
            r"^qmpprof-linux: maps of xz pid (\d+) begin\r?\n(.*?)^" + MAPS_END, text, re.M | re.S
        )
        if match is None:
            raise RuntimeError(f"{self.console}: no maps of xz")
        return int(match.group(1)), [parse_maps_line(line) for line in match.group(2).splitlines()]

    def churn_rates(self) -> list[ChurnRate]:
        """The churn workload's reports so far (every 5 s of guest time; ``qmpprof.churn``)."""
        found = re.findall(
            r"^qmpprof-linux: churn (\d+) processes in (\d+\.\d+) s", self.console_text(), re.M
        )
        return [ChurnRate(int(n), float(s)) for n, s in found]

    @cached_property
    def symbols(self) -> KernelSymbols:
        """The guest's /proc/kallsyms: runtime addresses, module symbols tagged."""
        return parse_symbol_map(self.kallsyms.read_text(), str(self.kallsyms))


def parse_maps_line(line: str) -> Mapping:
    """``start-end perms offset dev inode [path]``, as /proc/PID/maps writes it."""
    fields = line.split(maxsplit=5)
    start, end = (int(x, 16) for x in fields[0].split("-"))
    path = fields[5].strip() if len(fields) > 5 else ""
    return Mapping(start, end, fields[1], int(fields[2], 16), path)


_DUMPED = re.compile(r"qmpprof-linux: kallsyms (\d+) bytes at (0x[0-9a-f]+)")


def _read_kallsyms(guest: LinuxGuest) -> None:
    """Copy the dump init left in reserved RAM (its console line says where) into ``kallsyms``."""
    console = guest.console_text()
    found = _DUMPED.search(console)
    if found is None:
        said = [line for line in console.splitlines() if "qmpprof-linux: kallsyms" in line]
        raise RuntimeError(f"the guest made no kallsyms dump: {said or 'no line about it'}")
    size, at = int(found[1]), int(found[2], 16)
    raw = guest.kallsyms.with_suffix(".mem")
    with RawQmp(str(guest.qmp_socket)) as qmp:
        qmp.execute("pmemsave", {"val": at, "size": size, "filename": str(raw)})
    text = raw.read_bytes()
    raw.unlink()
    if len(text) != size or not text.rstrip().endswith(KALLSYMS_END.encode()):
        raise RuntimeError(f"the kallsyms dump at {at:#x} lacks its end line")
    guest.kallsyms.write_bytes(text)


PANIC = "Kernel panic - not syncing"
# Debian's x86_64 kernels (6.12 and 7.2 seen, ~4 boots in 60 of one CI run, on QEMU 7.2's
# multi-threaded TCG) sometimes die at boot on an "Oops: int3" while the kernel patches its
# own text (a static key: int3 on the first byte, the rest, then the first byte). The Oops
# dumps the code as memory holds it then: no int3 at the address the CPU trapped on, the patch
# long finished. A CPU cannot meet an int3 memory no longer holds unless it ran a translation
# made while the patch was under way (TCG's, stale); the kernel's own handler rightly claims
# only int3s of a patch in progress. Only such a boot is made again, up to STALE_INT3_BOOTS
# times; each is counted in BOOTS and conftest fails the session when they pass
# STALE_INT3_CEILING of the Linux boots. Any other panic at boot fails the test at once.
STALE_INT3 = "running_linux_guest: a stale int3 (TCG) panicked the kernel at boot, booted again"
STALE_INT3_BOOTS = 3  # attempts per guest
STALE_INT3_CEILING = 0.2  # of running_linux_guest's boots in a session
_MARKED = re.compile(r"([0-9a-f]{2}) <[0-9a-f]{2}>")


def stale_int3(console: str) -> bool:
    """Whether the console's first Oops is an int3 whose address (the byte before the one its
    Code line marks ``<..>``: x86 reports the pc after the int3) holds something else."""
    oops = console.find("Oops:")
    if oops < 0 or not console.startswith("Oops: int3", oops):
        return False
    code = next((line for line in console[oops:].splitlines() if "Code: " in line), "")
    marked = _MARKED.search(code)
    return marked is not None and marked[1] != "cc"


def stale_int3_over_ceiling() -> str | None:
    """The line that fails the session when stale-int3 boots passed their ceiling, else None."""
    stale, boots = qemumark.BOOTS[STALE_INT3], qemumark.BOOTS["running_linux_guest"]
    if stale <= max(1, STALE_INT3_CEILING * boots):
        return None
    ceiling = f"{STALE_INT3_CEILING:.0%}"
    return f"{stale} of {boots} Linux boots panicked on a stale int3: more than {ceiling}"


class PanickedAtBoot(RuntimeError):
    """The guest kernel panicked before the workload ran (its console in the message)."""

    def __init__(self, message: str, console: str) -> None:
        super().__init__(message)
        self.console = console


def wait_console(guest: LinuxGuest, text: str, timeout: float) -> None:
    """Wait until the guest console shows ``text``; PanickedAtBoot if the kernel panics first."""
    deadline = time.monotonic() + timeout
    while text not in (console := guest.console_text()):
        if PANIC in console:
            raise PanickedAtBoot(f"the kernel panicked before {text!r}:\n{console}", console)
        _check_alive(guest)
        if time.monotonic() > deadline:
            raise TimeoutError(f"console never showed {text!r}:\n{guest.console_text()}")
        time.sleep(0.05)


def wait_churn(guest: LinuxGuest, count: int, timeout: float) -> list[ChurnRate]:
    """Wait until the churn workload has reported ``count`` times; its reports."""
    deadline = time.monotonic() + timeout
    while len(rates := guest.churn_rates()) < count:
        _check_alive(guest)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} churn reports never came:\n{guest.console_text()}")
        time.sleep(0.2)
    return rates


@contextlib.contextmanager
def running_linux_guest(
    tmp_path: Path,
    *,
    kaslr: bool = False,
    smp: int = 2,
    gdb_port: int | None = None,
    paused: bool = False,
    wait_workload: bool = True,
    dump_kallsyms: bool = True,
    append: str = "",
    kernel: Path | None = None,
    witness: bool = False,
    go: bool = False,
) -> Iterator[LinuxGuest]:
    """Boot the guest and yield it once QMP accepts connections and, unless ``paused`` or
    ``wait_workload`` is False, the workload runs and the kallsyms dump is unpacked.
    ``dump_kallsyms=False`` boots several seconds faster, with no ``symbols``. ``kernel``: a
    bzImage other than 6.12's (``linux_dir(series) / "vmlinuz"``: the same initramfs, with
    the test module built for every kernel fetched before the guest was built; for another,
    init says "insmod failed" and runs a busybox loop in place of the ``sys`` workload).
    ``witness``: a second QMP socket (``witness_socket``) to watch the guest while qmpprof holds
    the first. ``go``: COM3 on a Unix socket (``send_go``), for ``qmpprof.late_module``."""
    qemumark.booting("running_linux_guest")
    build_linux_guest()
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    sock_dir = Path(tempfile.mkdtemp(prefix="lg-", dir="/tmp"))
    boot_dir = Path(
        tempfile.mkdtemp(prefix=f"linux-{'kaslr' if kaslr else 'nokaslr'}-", dir=tmp_path)
    )
    guest = LinuxGuest(
        qmp_socket=sock_dir / "qmp.sock",
        console=boot_dir / "console.txt",
        kallsyms=boot_dir / "kallsyms.txt",
        kaslr=kaslr,
        smp=smp,
        process=None,  # type: ignore[arg-type]  # set right below
        gdb_port=gdb_port,
        witness_socket=sock_dir / "witness.sock" if witness else None,
        go_socket=sock_dir / "go.sock" if go else None,
    )
    cmd = [
        str(ROOT / "scripts" / "run-linux-guest"),
        "--kaslr" if kaslr else "--no-kaslr",
        "--smp", str(smp),
        "--qmp-socket", str(guest.qmp_socket),
        "--console", str(guest.console),
    ]  # fmt: skip
    if gdb_port is not None:
        cmd += ["--gdb", str(gdb_port)]
    if paused:
        cmd.append("--paused")
    if kernel is not None:
        cmd += ["--kernel", str(kernel)]
    if guest.witness_socket is not None:
        cmd += ["--witness-socket", str(guest.witness_socket)]
    if guest.go_socket is not None:
        cmd += ["--go-socket", str(guest.go_socket)]
    if not dump_kallsyms:
        append = f"{append} qmpprof.nokallsyms".strip()
    if append:
        cmd += ["--append", append]
    try:
        for attempt in range(1, STALE_INT3_BOOTS + 1):
            try:
                _boot(guest, cmd, wait_workload and not paused, dump_kallsyms)
                break
            except PanickedAtBoot as panic:
                _stop(guest)
                if attempt == STALE_INT3_BOOTS or not stale_int3(panic.console):
                    raise
                qemumark.BOOTS[STALE_INT3] += 1
                for made in (guest.console, guest.qmp_socket):
                    made.unlink(missing_ok=True)
        yield guest
    finally:
        _stop(guest)
        shutil.rmtree(sock_dir, ignore_errors=True)


def _boot(guest: LinuxGuest, cmd: list[str], wait_workload: bool, dump_kallsyms: bool) -> None:
    start = time.monotonic()
    guest.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    deadline = start + BOOT_TIMEOUT
    _wait_qmp(guest, deadline)
    if wait_workload:
        wait_console(guest, WORKLOAD_LINE, max(deadline - time.monotonic(), 0.1))
        guest.boot_seconds = time.monotonic() - start
        if dump_kallsyms:
            _read_kallsyms(guest)


def _stop(guest: LinuxGuest) -> None:
    if guest.process is not None:
        guest.process.kill()  # run-linux-guest execs QEMU: this is QEMU's pid
        guest.process.wait()
