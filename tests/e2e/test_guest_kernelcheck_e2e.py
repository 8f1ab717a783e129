"""End to end on the bundled guest (tests/guestvm.py): the kernel file checked against the running
guest (the fp build's ELF on the cfi guest: exit 9, one line, the guest left running; the cfi
ELF profiles), the note without --kernel, and a boot sampled from its first instruction whose
[firmware] samples are those the vCPU's state says are the firmware's (the monitor's CR0 and pc
in the same pause, the kernel ELF's ranges read with pyelftools)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from guestvm import BUILD_ROOT, Guest, build_fixtures, run_state
from qemus import every_qemu

from qmpprof.cli import record
from qmpprof.naming import Naming, stack_names
from qmpprof.output import folded
from qmpprof.sampler import SamplerConfig
from qmpprof.session import NO_KERNEL, RunSpec, load, start
from qmpprof.transport.base import Reach

pytestmark = [pytest.mark.qemu, every_qemu]

OTHER_KERNEL = BUILD_ROOT / "fp" / "kernel.elf"  # the guest fixture boots the cfi build
RUN_TIMEOUT = 120.0


def qmpprof(guest: Guest, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT)


def test_another_builds_kernel_is_one_line_and_exit_9(guest: Guest, tmp_path: Path) -> None:
    assert OTHER_KERNEL.read_bytes() != guest.kernel_elf.read_bytes()
    out = tmp_path / "wrong.folded"
    done = qmpprof(guest, "--kernel", str(OTHER_KERNEL), "--duration", "1", "-o", str(out))
    assert done.returncode == 9, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("qmpprof: error: running kernel does not match the image: ")
    assert f"{OTHER_KERNEL}'s code differs from the guest's" in line
    assert not out.exists()  # nothing sampled
    assert run_state(guest.qmp_socket) == "running"


def test_the_guests_own_kernel_is_checked_and_profiles(guest: Guest, tmp_path: Path) -> None:
    out = tmp_path / "right.folded"
    done = qmpprof(guest, "--kernel", str(guest.kernel_elf), "--duration", "1", "-v",
                   "-o", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "qmpprof: the kernel file's code is the guest's\n" in done.stderr
    assert "note:" not in done.stderr  # the note without --kernel is not given
    names = {name for stack in folded.parse(out.read_text()) for name in stack[0]}
    assert names & {"kworker_main_[k]", "kthread_start_[k]", "idle_loop_[k]", "kmain_[k]"}, names
    assert run_state(guest.qmp_socket) == "running"


def test_without_kernel_one_note_says_what_is_missing(guest: Guest, tmp_path: Path) -> None:
    done = qmpprof(guest, "--duration", "0.2", "-o", str(tmp_path / "bare.folded"))
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if line.startswith("qmpprof: note:")]
    assert notes == [f"qmpprof: note: {NO_KERNEL}"]


# ---- a boot from its first instruction, each sample against the vCPU's state --------------

_CPU = re.compile(r"CPU#(\d+)\r?\n(.*?)(?=CPU#|\Z)", re.DOTALL)


def cpu_states(text: str) -> dict[int, tuple[int, int]]:
    """``info registers -a`` text: per vCPU, (CR0, pc: RIP or EIP)."""
    out = {}
    for cpu, block in _CPU.findall(text):
        cr0 = re.search(r"CR0=([0-9a-f]+)", block)
        pc = re.search(r"[RE]IP=([0-9a-f]+)", block)
        assert cr0 is not None and pc is not None, block
        out[int(cpu)] = (int(cr0[1], 16), int(pc[1], 16))
    return out


def kernel_ranges(path: Path) -> list[tuple[int, int]]:
    """The ELF's loaded segments, at their link and at their physical addresses."""
    with open(path, "rb") as f:
        loads = [s for s in ELFFile(f).iter_segments() if s["p_type"] == "PT_LOAD"]
        return [(s[key], s[key] + s["p_memsz"]) for s in loads for key in ("p_vaddr", "p_paddr")]


async def boot_samples(socket: Path, kernel: Path) -> list[tuple[tuple[str, ...], int, int]]:
    """The guest sampled paused, tick after tick, from its first instruction until a vCPU runs
    the kernel with paging on: each sample's names with the vCPU's CR0 and pc, as the monitor
    prints them in the same pause."""
    spec = RunSpec(reach=Reach(socket), kernel=kernel, sampling=SamplerConfig(duration=1.0))
    run = await start(spec, guest=load(spec))
    transport, control = run.transport, run.transport.control
    assert control is not None
    seen: list[tuple[tuple[str, ...], int, int]] = []
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while not any(cr0 >> 31 and names[0] == "kernel" for names, cr0, _ in seen):
            assert time.monotonic() < deadline, seen[-4:]
            outcome = await run.run()  # paused: one tick, the guest left paused
            assert not outcome.was_running
            states = cpu_states(await control.hmp("info registers -a"))
            for sample in outcome.last:
                stack = sample.stack
                names, _ = stack_names(sample.process, stack.frames, stack.stop, Naming())
                seen.append((names, *states[sample.cpu]))
            await transport.cont()
            await asyncio.sleep(0.005)  # the guest runs on a little between two ticks
            await transport.stop()
    finally:
        await transport.close()
    return seen


def test_a_boot_names_the_firmware_as_the_cpu_state_says(tmp_path: Path) -> None:
    build_fixtures(("cfi",))
    kernel = BUILD_ROOT / "cfi" / "kernel.elf"
    ranges = kernel_ranges(kernel)
    folder = Path(tempfile.mkdtemp(prefix="kc-", dir="/tmp"))  # short: a socket path
    command = ["qemu-system-x86_64", "-kernel", str(kernel), "-accel", "tcg", "-smp", "2",
               "-m", "128M", "-display", "none", "-no-reboot", "-monitor", "none",
               "-serial", f"file:{tmp_path / 'console.txt'}"]  # fmt: skip
    qemu = record.start(command, folder / "qmp.sock")
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not (folder / "qmp.sock").is_socket():
            assert qemu.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        seen = asyncio.run(boot_samples(folder / "qmp.sock", kernel))
    finally:
        qemu.kill()
        qemu.wait()
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    for names, cr0, pc in seen:
        firmware = not cr0 >> 31 and not any(lo <= pc < hi for lo, hi in ranges)
        # Every firmware sample is [firmware] (none under [unknown]), and nothing else is.
        assert (names == ("[firmware]",)) == firmware, (names, hex(cr0), hex(pc))
    real_mode = [names for names, cr0, _ in seen if not cr0 & 1]
    assert real_mode and all(names == ("[firmware]",) for names in real_mode)
    assert any(names[0] == "kernel" and "[firmware]" not in names for names, _, _ in seen)


def test_a_recorded_boot_checks_the_kernel_once_it_runs(tmp_path: Path) -> None:
    # Started paused at the reset vector, the guest holds no kernel yet: the first sample that
    # shows one checks it, before it is kept.
    build_fixtures(("cfi", "fp"))
    out = tmp_path / "boot.folded"
    command = [
        "qemu-system-x86_64",
        "-kernel",
        str(BUILD_ROOT / "cfi" / "kernel.elf"),
        "-accel",
        "tcg",
        "-m",
        "128M",
        "-display",
        "none",
        "-no-reboot",
        "-monitor",
        "none",
        "-serial",
        "none",
        "-pidfile",
        str(tmp_path / "qemu.pid"),
    ]
    flags = ["--duration", "30", "--interval", "2", "--kernel", str(OTHER_KERNEL),
             "-o", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "qmpprof", "record", *flags, "--", *command],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)  # fmt: skip
    assert done.returncode == 9, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("qmpprof: error: running kernel does not match the image: ")
    assert not (tmp_path / "qemu.pid").exists()  # record quit its QEMU in order
    # What was kept before the check: the firmware's samples, nothing of the kernel.
    assert {names for names, _ in folded.parse(out.read_text())} <= {("[firmware]",)}
    assert "Traceback" not in done.stderr
