"""Run the aarch64 test guest (Debian's arm64 kernel + fixtures/aarch64-guest) under
qemu-system-aarch64 for tests: bookworm's 6.1 and 6.12, and unstable's 7.x, all with one
initramfs (bookworm's busybox, unstable's xz, liblzma and libc: scripts/build-aarch64-guest).

``running_aarch64_guest`` boots it through scripts/run-aarch64-guest (KASLR on), waits for the
workload line on the console, decodes the guest's own /proc/kallsyms (gzipped and base64-encoded
on the console by init) and kills QEMU afterwards, whatever happens.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gzip
import re
import shutil
import subprocess
import tempfile
import time
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import qemumark
from guestvm import _check_alive, _die_with_parent, _wait_qmp
from linuxvm import Mapping, parse_maps_line

from qmpprof.linux.symbols import TEXT_TYPES, KernelSymbols, parse_symbol_map

ROOT = Path(__file__).resolve().parent.parent
# The long-lived xz's /proc/PID/maps, as fixtures/aarch64-guest/init prints them.
_XZ_MAPS = re.compile(
    r"^qmpprof-aarch64: maps of xz pid (\d+) feeder (\d+) begin\r?\n(.*?)"
    r"^qmpprof-aarch64: maps end",
    re.M | re.S,
)
SERIES = {
    "6.1": ROOT / "fixtures" / "build" / "linux-arm64-6.1",
    "6.12": ROOT / "fixtures" / "build" / "linux-arm64",
    "7": ROOT / "fixtures" / "build" / "linux-arm64-7",
}
# The series the test module is cross-built for (scripts/build-aarch64-guest, AARCH64_SERIES of
# scripts/linux-series.sh): bookworm's cross compiler and kbuild are not 7.x's, so the 7.x guest
# runs without it (init says "insmod failed"; the module's checks are left out there, said).
WITH_MODULE = frozenset({"6.1", "6.12"})
WORKLOAD_LINE = "qmpprof-aarch64: workload running"
_DUMP = re.compile(r"qmpprof-aarch64: kallsyms begin\r?\n(.*?)qmpprof-aarch64: kallsyms end", re.S)
# 16 s on an idle 2-core machine (8 of them the kallsyms dump): a guard against a hung boot.
BOOT_TIMEOUT = 300.0


@dataclass
class Aarch64Guest:
    """One running qemu-system-aarch64 with the aarch64 test guest."""

    qmp_socket: Path
    console: Path
    series: str  # a key of SERIES
    kernel: Path
    process: subprocess.Popen[bytes]
    boot_seconds: float = 0.0
    symbols: KernelSymbols = field(init=False)

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""

    def xz_maps(self, timeout: float = 60.0) -> tuple[int, list[Mapping]]:
        """The pid of the guest's long-lived xz and its /proc/PID/maps, as /init prints them
        once in the background after the workload line (waited for up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while (match := _XZ_MAPS.search(self.console_text())) is None:
            _check_alive(self)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.console}: no maps of xz")
            time.sleep(0.1)
        return int(match[1]), [parse_maps_line(line) for line in match[3].splitlines()]

    def xz_feed(self) -> tuple[int, int]:
        """The pids of the long-lived xz and of the loop feeding it (both run every 2 s)."""
        self.xz_maps()
        match = _XZ_MAPS.search(self.console_text())
        assert match is not None
        return int(match[1]), int(match[2])


def image(series: str) -> Path:
    return SERIES[series] / "vmlinuz"


def module_ko(series: str) -> Path:
    """The test module built for the series' kernel, with its symbols (the guest loads a
    copy): scripts/build-aarch64-guest's module-<release>/qmpprof_burn.ko."""
    release = (SERIES[series] / "version").read_text().strip()
    return ROOT / "fixtures" / "build" / "aarch64-guest" / f"module-{release}" / "qmpprof_burn.ko"


@contextlib.contextmanager
def running_aarch64_guest(
    tmp_path: Path,
    series: str = "6.1",
    *,
    dump_kallsyms: bool = True,
    append: str = "",
    gdb_port: int | None = None,
    cpu: str = "max",
) -> Iterator[Aarch64Guest]:
    """Boot the guest on the arm64 ``series`` kernel and yield it once the workload
    runs and the guest's kallsyms are decoded (``dump_kallsyms=False``: 8 s sooner, no
    ``symbols``); ``append``: more kernel parameters; ``gdb_port``: QEMU's gdbstub there;
    ``cpu``: QEMU's -cpu (``cortex-a57``: KPTI, where ``max`` has E0PD)."""
    qemumark.booting("running_aarch64_guest")
    sock_dir = Path(tempfile.mkdtemp(prefix="a64-", dir="/tmp"))  # short Unix socket paths
    guest = Aarch64Guest(
        qmp_socket=sock_dir / "qmp.sock",
        console=tmp_path / f"aarch64-{series}-console.txt",
        series=series,
        kernel=image(series),
        process=None,  # type: ignore[arg-type]  # set right below
    )
    cmd = [
        str(ROOT / "scripts" / "run-aarch64-guest"),
        "--qmp-socket", str(guest.qmp_socket),
        "--console", str(guest.console),
        "--kernel", str(guest.kernel),
        "--cpu", cpu,
    ]  # fmt: skip
    extra = append if dump_kallsyms else f"{append} qmpprof.nokallsyms"
    if extra.strip():
        cmd += ["--append", extra.strip()]
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
        if dump_kallsyms:
            guest.symbols = _kallsyms(guest)
        yield guest
    finally:
        guest.process.kill()  # run-aarch64-guest execs QEMU: this is QEMU's pid
        guest.process.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _kallsyms(guest: Aarch64Guest) -> KernelSymbols:
    return parse_symbol_map(kallsyms_text(guest), str(guest.console))


def kallsyms_text(guest: Aarch64Guest) -> str:
    """The guest's /proc/kallsyms, as init dumped it on the console."""
    found = _DUMP.search(guest.console_text())
    if found is None:
        raise RuntimeError(f"{guest.console}: no kallsyms dump")
    try:
        text = gzip.decompress(base64.b64decode("".join(found[1].split())))
    except (binascii.Error, OSError, EOFError, zlib.error) as err:
        raise RuntimeError(f"{guest.console}: the kallsyms dump does not decode: {err}") from err
    return text.decode()


class TextSymbols:
    """The text symbols of a /proc/kallsyms, by address."""

    def __init__(self, symbols: KernelSymbols) -> None:
        text = [i for i, kind in enumerate(symbols.types) if kind in TEXT_TYPES]
        self.starts = [symbols.addrs[i] for i in text]
        self.names = [symbols.names[i] for i in text]

    def names_at(self, addr: int) -> set[str]:
        """The names of the symbol (and its aliases) holding ``addr``."""
        at = bisect_right(self.starts, addr) - 1
        first = bisect_left(self.starts, self.starts[at])
        return set(self.names[first : at + 1])


# arch/arm64/kernel/entry.S's code for exceptions from user mode (from 5.12): a handler per
# kind and register size, each calling a C function of its name + "_handler"
# (el0t_64_irq_handler), an ordinary frame above it; and the way back to user mode.
USER_ENTRIES = frozenset(
    [f"el0t_{bits}_{kind}" for bits in (64, 32) for kind in ("sync", "irq", "fiq", "error")]
    + ["ret_to_user"]
)


def from_user_entry(frame: dict[str, object]) -> bool:
    """A frame in the vector table's user half, a user-mode handler or on the way back to user
    mode: nothing of the kernel's lies below it. Not the C functions those handlers call."""
    symbol, offset = frame.get("symbol"), frame.get("offset")
    if symbol == "vectors":
        return isinstance(offset, int) and offset >= 0x400
    return symbol in USER_ENTRIES


def past_user_entry(frames: Sequence[dict[str, object]]) -> bool:
    """Whether a one-shot's kernel frames (leaf first) go on past an entry from user mode,
    below which nothing of the kernel's lies."""
    return any(from_user_entry(frame) for frame in frames[:-1])


def from_kernel_entry(frame: dict[str, object]) -> bool:
    """A frame in a kernel-mode vector entry or handler (the exception came from the kernel)."""
    symbol, offset = frame.get("symbol"), frame.get("offset")
    if symbol == "vectors":
        return isinstance(offset, int) and 0x200 <= offset < 0x400
    return isinstance(symbol, str) and symbol.startswith("el1h_64_")


def named_at(frames: Sequence[dict[str, object]], i: int) -> int:
    """Where the guest's kallsyms must name frame ``i`` of a one-shot's JSON stack (leaf
    first), as gdb names frames: the leaf, and the code an exception taken in the kernel
    interrupted (the frame after a kernel-mode entry: ELR_EL1, where the CPU was, which may be
    a function's first instruction), at their address; a caller at its return address - 1
    (its call, which may end the function); a tail-call frame at its address - 1 too (its
    address is after its jump, so the jump: the jumper)."""
    address = frames[i]["address"]
    assert isinstance(address, str)
    addr = int(address, 16)
    if frames[i].get("tail_call"):
        return addr - 1
    return addr if i == 0 or from_kernel_entry(frames[i - 1]) else addr - 1
