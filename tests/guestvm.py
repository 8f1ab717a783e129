"""Run the bundled guest (fixtures/guest) under QEMU for tests, and ask gdb about it.

``running_guest`` boots one guest and kills its QEMU whatever happens; ``gdb_backtrace`` is the
oracle the unwinders are judged against (Debian's gdb through QEMU's gdbstub);
``current_user_elf`` tells which user program a vCPU is running (by its ``.text`` bytes).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import qemumark
from elftools.elf.elffile import ELFFile
from qemu.qmp import ExecuteError, QMPClient

ROOT = Path(__file__).resolve().parent.parent
GUEST_SOURCES = ROOT / "fixtures" / "guest"
BUILD_ROOT = ROOT / "fixtures" / "build"
EXPECTED_JSON = GUEST_SOURCES / "expected.json"
WORKLOAD_LINE = "qmpprof-guest: workload running"
METADATA_ADDR = 0xFFFF_FF7F_FFFF_E000
METADATA_FIELDS = (
    "pid",
    "image_base",
    "image_size",
    "program_headers_offset",
    "eh_frame_address",
    "eh_frame_size",
    "text_address",
    "text_size",
)

# A loaded 2-core machine boots the guest in well under a second; these leave room for load.
BOOT_TIMEOUT = 30.0
GDB_TIMEOUT = 60.0

_build_lock = threading.Lock()
_built: set[str] = set()


def build_fixtures(variants: tuple[str, ...] | None = None) -> None:
    """Run scripts/build-fixtures once per test session for ``variants`` (default: every one;
    make itself skips fresh outputs)."""
    key = "*" if variants is None else " ".join(variants)
    env = dict(os.environ, QMPPROF_GUEST_VARIANTS=key) if variants is not None else None
    with _build_lock:
        if key not in _built and "*" not in _built:
            subprocess.run([ROOT / "scripts" / "build-fixtures"], check=True, env=env)
            _built.add(key)


def expected(variant: str | None = None) -> dict[str, Any]:
    """fixtures/guest/expected.json: the workload shape the guest promises; for a ``variant``
    of ``arch_variants`` (i386, i386-pae), with that entry's keys over the top-level ones (and
    over those of the entry it ``extends``)."""
    data: dict[str, Any] = json.loads(EXPECTED_JSON.read_text())
    entries = data["arch_variants"]
    chain = []
    while variant is not None and variant in entries:
        chain.append(entries[variant])
        variant = entries[variant].get("extends")
    for entry in reversed(chain):
        data = {**data, **entry}
    data.pop("extends", None)
    return data


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for QEMU's gdbstub)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Guest:
    """One running QEMU with the bundled guest."""

    qmp_socket: Path
    console: Path
    variant: str
    smp: int
    build_dir: Path
    process: subprocess.Popen[bytes]
    gdb_port: int | None
    qemu: str | None = None

    @property
    def kernel_elf(self) -> Path:
        return self.build_dir / "kernel.elf"

    @property
    def user_dir(self) -> Path:
        return self.build_dir / "user"

    def user_elf(self, program: str) -> Path:
        return self.user_dir / f"{program}.elf"

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""


class Booting(Protocol):
    """What waiting for a QEMU to come up needs (Guest here, LinuxGuest in linuxvm.py)."""

    process: subprocess.Popen[bytes]
    qmp_socket: Path

    def console_text(self) -> str: ...


def _check_alive(guest: Booting) -> None:
    if guest.process.poll() is not None:
        raise RuntimeError(
            f"QEMU exited with {guest.process.returncode}; console:\n{guest.console_text()}"
        )


def _wait_qmp(guest: Booting, deadline: float) -> None:
    while True:
        _check_alive(guest)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(guest.qmp_socket))
                return
            except (FileNotFoundError, ConnectionRefusedError):
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"QMP socket {guest.qmp_socket} never accepted a connection")
        time.sleep(0.01)


def wait_console(guest: Guest, text: str, timeout: float = BOOT_TIMEOUT) -> None:
    """Wait until the guest console shows ``text``."""
    deadline = time.monotonic() + timeout
    while text not in guest.console_text():
        _check_alive(guest)
        if time.monotonic() > deadline:
            raise TimeoutError(f"console never showed {text!r}:\n{guest.console_text()}")
        time.sleep(0.01)


def _die_with_parent() -> None:
    """Runs in the child before exec: if the test process is killed outright (no cleanup),
    the kernel kills QEMU too (PR_SET_PDEATHSIG survives run-guest's exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def running_guest(
    tmp_path: Path,
    variant: str = "cfi",
    smp: int = 1,
    *,
    paused: bool = False,
    gdb_port: int | None = None,
    wait_workload: bool = True,
    qemu: str | None = None,
    sock_dir: Path | None = None,
) -> Iterator[Guest]:
    """Boot the guest (scripts/run-guest) and yield it once QMP accepts connections and, unless
    ``paused`` or ``wait_workload`` is False, the console shows the workload line. ``qemu``: the
    QEMU binary (default: run-guest's for the variant). The QMP socket is ``qmp.sock`` in
    ``sock_dir`` when given (to boot again on the same socket; the caller removes the
    directory), else in a directory of its own."""
    qemumark.booting("running_guest")
    build_fixtures((variant,))
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    own_dir = sock_dir is None
    sock_dir = Path(tempfile.mkdtemp(prefix="qg-", dir="/tmp")) if sock_dir is None else sock_dir
    # A fresh, empty file per boot: a console left by an earlier boot would show the workload
    # line before this QEMU has even truncated the file.
    fd, console_name = tempfile.mkstemp(
        prefix=f"console-{variant}-smp{smp}-", suffix=".txt", dir=tmp_path
    )
    os.close(fd)
    console = Path(console_name)
    cmd = [
        str(ROOT / "scripts" / "run-guest"),
        "--variant", variant,
        "--smp", str(smp),
        "--qmp-socket", str(sock_dir / "qmp.sock"),
        "--console", str(console),
    ]  # fmt: skip
    if gdb_port is not None:
        cmd += ["--gdb", str(gdb_port)]
    if paused:
        cmd.append("--paused")
    if qemu is not None:
        cmd += ["--qemu", qemu]
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    guest = Guest(
        qmp_socket=sock_dir / "qmp.sock",
        console=console,
        variant=variant,
        smp=smp,
        build_dir=BUILD_ROOT / variant,
        process=process,
        gdb_port=gdb_port,
        qemu=qemu,
    )
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT
        _wait_qmp(guest, deadline)
        if wait_workload and not paused:
            wait_console(guest, WORKLOAD_LINE, max(deadline - time.monotonic(), 0.1))
        yield guest
    finally:
        process.kill()  # run-guest execs QEMU: this is QEMU's pid
        process.wait()
        if own_dir:
            shutil.rmtree(sock_dir, ignore_errors=True)


# spawn_user's console line (kernel/mm.c): one per process, with its CR3.
_PROCESS_LINE = re.compile(r"process (\d+) '(\w+)' cr3=([0-9a-f]+) ")


def run_state(qmp_socket: Path) -> str:
    """The VM's run state as QMP query-status says it ("running", "paused", ...), asked over a
    connection of its own."""
    from qmpprof.transport.qmp import QmpTransport

    async def ask() -> str:
        transport = await QmpTransport.connect(qmp_socket)
        try:
            return await transport.status()
        finally:
            await transport.close()

    return asyncio.run(ask())


def set_running(qmp_socket: Path, running: bool) -> None:
    """Resume (``running``) or pause the VM, over a QMP connection of its own."""
    from qmpprof.transport.qmp import QmpTransport

    async def order() -> None:
        transport = await QmpTransport.connect(qmp_socket)
        try:
            await (transport.cont() if running else transport.stop())
        finally:
            await transport.close()

    asyncio.run(order())


def process_cr3s(guest: Guest) -> dict[int, tuple[str, int]]:
    """pid -> (program, CR3) of every process, as the guest printed them at boot."""
    found = _PROCESS_LINE.findall(guest.console_text())
    return {int(pid): (program, int(cr3, 16)) for pid, program, cr3 in found}


def section(elf: ELFFile, name: str) -> Any:
    """A section that must exist (pyelftools' types do not narrow symbol tables)."""
    found = elf.get_section_by_name(name)
    assert found is not None, f"no {name} section"
    return found


class SymbolIndex:
    """Function symbols of one ELF, sorted, for naming addresses."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as f:
            symtab = section(ELFFile(f), ".symtab")
            funcs = sorted(
                (s["st_value"], s["st_value"] + max(s["st_size"], 1), s.name)
                for s in symtab.iter_symbols()
                if s["st_info"]["type"] == "STT_FUNC"
            )
        self.starts = [start for start, _, _ in funcs]
        self.funcs = funcs

    def name(self, pc: int) -> str | None:
        i = bisect.bisect_right(self.starts, pc) - 1
        if i >= 0 and pc < self.funcs[i][1]:
            name: str = self.funcs[i][2]
            return name
        return None


# ---- which user program is running ----------------------------------------------------------


@cache
def _text_of(path: Path) -> tuple[int, bytes]:
    with path.open("rb") as f:
        text = section(ELFFile(f), ".text")
        return text["sh_addr"], text.data()


def user_elf_for_text(user_dir: Path, text_address: int, text: bytes) -> Path | None:
    """The ELF in ``user_dir`` whose .text sits at ``text_address`` with exactly these bytes."""
    for path in sorted(user_dir.glob("*.elf")):
        if _text_of(path) == (text_address, text):
            return path
    return None


def parse_metadata(page: bytes) -> dict[str, int]:
    """The eight u64 fields of the Emerald metadata page."""
    return dict(zip(METADATA_FIELDS, struct.unpack_from("<8Q", page), strict=True))


async def memsave(qmp: QMPClient, addr: int, size: int, cpu: int = 0) -> bytes:
    """Read guest-virtual memory through QMP ``memsave`` as ``cpu`` sees it (its CR3).

    The address goes out as a signed int64 and the
    bytes come back through a private temporary file (QEMU writes it on this host).
    """
    fd, name = tempfile.mkstemp(prefix="qg-mem-")
    os.close(fd)
    try:
        signed = addr - (1 << 64) if addr >= 1 << 63 else addr
        await qmp.execute(
            "memsave", {"val": signed, "size": size, "filename": name, "cpu-index": cpu}
        )
        return Path(name).read_bytes()
    finally:
        os.unlink(name)


async def current_metadata(qmp: QMPClient, cpu: int = 0) -> dict[str, int] | None:
    """The metadata page under ``cpu``'s CR3, or None if none is mapped (a kernel thread)."""
    try:
        return parse_metadata(await memsave(qmp, METADATA_ADDR, 64, cpu))
    except ExecuteError:
        return None


async def current_user_elf(qmp: QMPClient, guest: Guest, cpu: int = 0) -> Path | None:
    """The user ELF of the process current on ``cpu`` (guest stopped), by its .text bytes."""
    meta = await current_metadata(qmp, cpu)
    if meta is None or meta["text_size"] == 0:
        return None
    text = await memsave(qmp, meta["text_address"], meta["text_size"], cpu)
    return user_elf_for_text(guest.user_dir, meta["text_address"], text)


# ---- gdb, the oracle ------------------------------------------------------------------------

# Runs inside gdb (its own Python): pick the user ELF by the .text bytes the current process
# has in memory (QGUSER=auto), load its symbols, then print one line per real frame. Inlined
# frames are skipped (a profiler names real frames), signal frames (the entry stubs) are named
# by the symbol holding their pc, as gdb itself prints only "<signal handler called>".
_GDB_SCRIPT = r"""
import hashlib, json, os
import gdb

def _pick_user_elf():
    candidates = json.loads(os.environ["QGCANDIDATES"])
    inferior = gdb.selected_inferior()
    try:
        meta = bytes(inferior.read_memory(int(os.environ["QGMETA"]), 64))
    except gdb.MemoryError:
        return None
    words = [int.from_bytes(meta[i:i + 8], "little") for i in range(0, 64, 8)]
    text_address, text_size = words[6], words[7]
    if text_size == 0 or text_size > 1 << 24:
        return None
    digest = hashlib.sha256(bytes(inferior.read_memory(text_address, text_size))).hexdigest()
    for path, (address, sha) in candidates.items():
        if (address, sha) == (text_address, digest):
            return path
    return None

def _symbol_at(pc):
    text = gdb.execute("info symbol %#x" % pc, to_string=True)
    return "??" if text.startswith("No symbol") else text.split()[0]

if os.environ.get("QGUSER") == "auto":
    chosen = _pick_user_elf()
    print("QGUSER %s" % chosen)
    if chosen is not None:
        gdb.execute("add-symbol-file %s" % chosen, to_string=True)
frame = gdb.newest_frame()
depth = 0
while frame is not None and depth < 128:
    if frame.type() != gdb.INLINE_FRAME:
        name = frame.name()
        if frame.type() == gdb.SIGTRAMP_FRAME or name is None:
            name = _symbol_at(frame.pc())
        print("QGFRAME %#x %s" % (frame.pc(), name))
        depth += 1
    try:
        frame = frame.older()
    except gdb.error as err:
        print("QGSTOP %s" % err)
        break
"""

_FRAME = re.compile(r"^QGFRAME (0x[0-9a-f]+) (\S+)$", re.MULTILINE)
_CHOSEN = re.compile(r"^QGUSER (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class GdbStack:
    """A stack as gdb unwound it: (pc, function name) pairs, leaf first, and the user ELF whose
    symbols gdb had (None: kernel symbols only)."""

    frames: list[tuple[int, str]]
    user_elf: Path | None

    @property
    def names(self) -> list[str]:
        return [name for _, name in self.frames]


def user_breakpoint_condition(user_elf: Path) -> str:
    """A gdb condition true only in a process running ``user_elf``: every program is linked at
    the same address, so a breakpoint on a user address fires in all of them."""
    address, text = _text_of(user_elf)
    first = struct.unpack_from("<Q", text)[0]
    size_field = METADATA_ADDR + 8 * METADATA_FIELDS.index("text_size")
    return (
        f"*(unsigned long long *){size_field:#x} == {len(text):#x} && "
        f"*(unsigned long long *){address:#x} == {first:#x}"
    )


def gdb_stack(
    guest: Guest,
    user_elf: Path | str | None = "auto",
    *,
    cpu: int = 0,
    breakpoint: str | None = None,
    condition: str | None = None,
    timeout: float = GDB_TIMEOUT,
    architecture: str | None = None,
) -> GdbStack:
    """The stack gdb unwinds, with pcs (see ``gdb_backtrace``); ``architecture``: gdb's
    ``set architecture`` before it reads the ELF files (i386)."""
    if guest.gdb_port is None:
        raise ValueError("the guest was started without a gdbstub (gdb_port)")
    candidates = {
        str(p): [_text_of(p)[0], hashlib.sha256(_text_of(p)[1]).hexdigest()]
        for p in sorted(guest.user_dir.glob("*.elf"))
    }
    env = dict(os.environ, QGCANDIDATES=json.dumps(candidates), QGMETA=str(METADATA_ADDR))
    if user_elf == "auto":
        env["QGUSER"] = "auto"
    elif user_elf is not None:
        env["QGUSER"] = "given"
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="qg-gdb-") as script:
        script.write(_GDB_SCRIPT)
        script.flush()
        commands = [*_stop_commands(cpu, breakpoint, condition), f"source {script.name}"]
        given = Path(user_elf) if isinstance(user_elf, (str, Path)) and user_elf != "auto" else None
        output = run_gdb(guest, given, commands, timeout, env, architecture)
    frames = [(int(pc, 16), name) for pc, name in _FRAME.findall(output)]
    if not frames:
        raise RuntimeError(f"gdb printed no backtrace:\n{output}")
    chosen = _CHOSEN.search(output)
    if chosen is not None:
        given = None if chosen.group(1) == "None" else Path(chosen.group(1))
    return GdbStack(frames, given)


def gdb_backtrace(
    guest: Guest,
    user_elf: Path | str | None = "auto",
    *,
    cpu: int = 0,
    breakpoint: str | None = None,
    condition: str | None = None,
    timeout: float = GDB_TIMEOUT,
) -> list[str]:
    """Function names of a stack as gdb unwinds it, leaf first ("??" where no symbol covers).

    Without ``breakpoint``: the current stack of vCPU ``cpu``; gdb stops the guest on connect.
    With ``breakpoint`` (a gdb location, optionally ``condition``): run until it is hit on any
    vCPU and take that stack. ``user_elf``: the user program whose symbols gdb loads (at its
    link addresses), "auto" to pick it by the .text bytes of the current process (metadata page),
    None for kernel symbols only. gdb disconnects at the end and the guest stays stopped
    (QMP status "debug"; resume it with QMP ``cont``).
    """
    return gdb_stack(
        guest, user_elf, cpu=cpu, breakpoint=breakpoint, condition=condition, timeout=timeout
    ).names


def _stop_commands(cpu: int, breakpoint: str | None, condition: str | None) -> list[str]:
    if breakpoint is None:
        return [f"thread {cpu + 1}"]
    where = f"break {breakpoint}" + (f" if {condition}" if condition else "")
    return [where, "continue", "delete"]


def run_gdb(
    guest: Guest,
    user_elf: Path | None,
    commands: list[str],
    timeout: float = GDB_TIMEOUT,
    env: dict[str, str] | None = None,
    architecture: str | None = None,
) -> str:
    """Run gdb in batch mode against the guest's gdbstub; returns what gdb printed. gdb
    disconnects at the end, leaving the guest stopped."""
    args = ["gdb", "-batch", "-nx", "-ex", "set pagination off", "-ex", "set confirm off"]
    if architecture is not None:
        args += ["-ex", f"set architecture {architecture}"]
    # gdb stops at main and at the ELF entry by default; the oracle must see the whole stack.
    args += ["-ex", "set backtrace past-main on", "-ex", "set backtrace past-entry on"]
    args += ["-ex", f"file {guest.kernel_elf}"]
    if user_elf is not None:
        args += ["-ex", f"add-symbol-file {user_elf}"]
    args += ["-ex", f"target remote 127.0.0.1:{guest.gdb_port}"]
    for command in [*commands, "disconnect"]:
        args += ["-ex", command]
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    return done.stdout + done.stderr
