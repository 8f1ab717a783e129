"""``qmpprof record`` with real QEMU runs as subprocesses: the bundled guest's boot profiled from
its first instruction, the end at --duration, a guest that powers off by itself, SIGTERM and
Ctrl-C mid-run, QEMU failing to start, a kernel ELF it cannot use.

Every recording runs in a session of its own, killed whole if the test fails half-way, and
QEMU's -pidfile shows whether record stopped it (QEMU deletes the file on an orderly exit).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from guestvm import BUILD_ROOT, WORKLOAD_LINE, build_fixtures, run_state
from qemus import QEMU, every_qemu
from qmpevents import wait_stops

from qmpprof.cli import main
from qmpprof.output import folded

KERNEL = BUILD_ROOT / "cfi" / "kernel.elf"
USER_DIR = BUILD_ROOT / "cfi" / "user"
WORKLOAD = {"kworker_main_[k]", "spin_hot", "spin_cold", "sys_user_work", "compute_leaf_[k]"}
RUN_TIMEOUT = 120.0  # a loaded 2-core host runs TCG guests many times slower than usual
PAUSES = 5  # qmpprof's pauses seen while the workload runs before a test stops the run

# A multiboot guest that spins a moment, then powers the machine off through the PIIX4 ACPI
# PM1a control register (port 0x604 on QEMU's pc machine, once SeaBIOS has set it up: S5).
POWER_OFF_GUEST = """
        .text
        .code32
        .globl _start
        .align 4
        .long 0x1BADB002, 0, -0x1BADB002   # multiboot magic, flags, checksum
_start: mov $0x4000000, %ecx
1:      dec %ecx
        jnz 1b
        mov $0x604, %dx
        mov $0x2000, %ax                   # SLP_EN | SLP_TYP 0: soft off
        outw %ax, %dx
        ud2
"""


# ---- real QEMU ------------------------------------------------------------------------------


def guest_command(tmp_path: Path, smp: int = 1, *extra: str) -> list[str]:
    """The bundled guest's QEMU command line (scripts/run-guest's), console and pid in files."""
    build_fixtures()
    return [
        QEMU, "-kernel", str(KERNEL), "-accel", "tcg", "-smp", str(smp), "-m", "128M",
        "-display", "none", "-no-reboot", "-monitor", "none",
        "-serial", f"file:{tmp_path / 'console.txt'}", "-pidfile", str(tmp_path / "qemu.pid"),
        *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def recording(flags: list[str], command: list[str]) -> Iterator[subprocess.Popen[str]]:
    """``qmpprof record`` as a subprocess in a session of its own (killed whole afterwards)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "qmpprof", "record", *flags, "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def wait_for(path: Path, text: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while text not in (path.read_text(errors="replace") if path.exists() else ""):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never showed {text!r}"
        time.sleep(0.05)


def user_qmp(folder: Path) -> list[str]:
    """A QMP socket of the user's own, next to qmpprof's (``folder``: a short path)."""
    return ["-qmp", f"unix:{folder / 'user.sock'},server=on,wait=off"]


def samples(path: Path) -> dict[tuple[str, ...], int]:
    return dict(folded.parse(path.read_text()))


def qemu_pid(tmp_path: Path) -> int:
    return int((tmp_path / "qemu.pid").read_text())


def gone(pid: int) -> bool:
    """The process has ended and been reaped (by record, its parent)."""
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.qemu
@every_qemu
def test_record_profiles_the_boot_from_the_first_instruction(tmp_path: Path) -> None:
    out = tmp_path / "boot.folded"
    flags = ["--duration", "0.5", "--interval", "2", "--kernel", str(KERNEL), "-o", str(out)]
    with recording(flags, guest_command(tmp_path, 2)) as proc:
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, err
    stacks = samples(out)
    # kmain brings up the second vCPU (INIT-SIPI-SIPI and delay loops): milliseconds of guest
    # time, which 2 ms samples from the first instruction on see. Before it ran the firmware
    # (SeaBIOS, the PVH loader): [firmware], not walked (test_guest_kernelcheck_e2e checks each
    # such sample against the vCPU's state).
    assert any("kmain_[k]" in names for names in stacks), stacks
    assert stacks[("[firmware]",)] > 0, stacks
    # The end came from --duration (0.5 s / 2 ms = 250 ticks), then qmpprof quit QEMU, which
    # exited in order (it deletes its pid file then).
    assert " 250 ticks" in err
    assert err.splitlines()[-1] == f"qmpprof: stopped {QEMU}"
    assert not (tmp_path / "qemu.pid").exists()
    assert "Traceback" not in err


@pytest.mark.qemu
@every_qemu
def test_a_guest_that_powers_off_ends_the_recording_normally(tmp_path: Path) -> None:
    if shutil.which("as") is None or shutil.which("ld") is None:
        pytest.fail("binutils (as, ld) are needed to build the power-off guest: run scripts/setup")
    source, elf = tmp_path / "off.S", tmp_path / "off.elf"
    source.write_text(POWER_OFF_GUEST)
    subprocess.run(["as", "--32", str(source), "-o", str(tmp_path / "off.o")], check=True)
    subprocess.run(
        ["ld", "-m", "elf_i386", "-Ttext=0x100000", "-e", "_start", "-o", str(elf),
         str(tmp_path / "off.o")],
        check=True,
    )  # fmt: skip
    out = tmp_path / "off.folded"
    command = [QEMU, "-accel", "tcg", "-kernel", str(elf), "-display", "none", "-no-reboot",
               "-monitor", "none", "-serial", "none"]  # fmt: skip
    with recording(["--duration", "60", "--kernel", str(elf), "-o", str(out)], command) as proc:
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, err
    assert err.splitlines()[-1] == f"qmpprof: {QEMU} exited (status 0); profiled until then"
    assert f"Wrote {out}" in err
    # Partial but whole: every sample of the run until QEMU exited, one a tick (one vCPU),
    # the guest's loop among them (the firmware's before it has no symbols).
    stacks = samples(out)
    total = sum(stacks.values())
    assert f"Samples: {total} " in err and f" {total} ticks" in err, (stacks, err)
    assert any(names[-1] == "_start_[k]" for names in stacks), stacks
    assert "Traceback" not in err


@pytest.mark.qemu
@every_qemu
def test_sigterm_stops_sampling_writes_output_and_quits_qemu(tmp_path: Path) -> None:
    out = tmp_path / "term.folded"
    user_dir = Path(tempfile.mkdtemp(prefix="qr-", dir="/tmp"))  # short: a socket path
    try:
        # The user's own -qmp stays usable next to qmpprof's.
        flags = ["--duration", "300", "--user-dir", str(USER_DIR), "-v"]
        with recording([*flags, "--kernel", str(KERNEL), "-o", str(out)],
                       guest_command(tmp_path, 1, *user_qmp(user_dir))) as proc:  # fmt: skip
            wait_for(tmp_path / "console.txt", WORKLOAD_LINE, proc)
            # It answers; "paused" when the question lands inside one of qmpprof's samples.
            assert run_state(user_dir / "user.sock") in ("running", "paused")
            pid = qemu_pid(tmp_path)
            wait_stops(user_dir / "user.sock", PAUSES, RUN_TIMEOUT)  # samples of the workload taken
            proc.send_signal(signal.SIGTERM)  # qmpprof only, not its QEMU
            _, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        shutil.rmtree(user_dir, ignore_errors=True)
    assert proc.returncode == 0, err
    assert err.splitlines()[-1] == f"qmpprof: stopped {QEMU}"
    assert gone(pid) and not (tmp_path / "qemu.pid").exists()
    # record takes the fast path (a private gdbstub) as the bare command does.
    assert "qmpprof: samples travel through a private gdbstub opened over QMP\n" in err
    stacks = samples(out)
    assert f"Samples: {sum(stacks.values())} " in err
    assert WORKLOAD & {name for names in stacks for name in names}, stacks


@pytest.mark.qemu
@every_qemu
def test_ctrl_c_reaches_qmpprof_and_qemu_and_the_output_is_written(tmp_path: Path) -> None:
    out = tmp_path / "int.folded"
    flags = ["--duration", "300", "--kernel", str(KERNEL), "--user-dir", str(USER_DIR)]
    user_dir = Path(tempfile.mkdtemp(prefix="qr-", dir="/tmp"))  # short: a socket path
    try:
        command = guest_command(tmp_path, 1, *user_qmp(user_dir))
        with recording([*flags, "-o", str(out)], command) as proc:
            wait_for(tmp_path / "console.txt", WORKLOAD_LINE, proc)
            pid = qemu_pid(tmp_path)
            # Samples of the workload taken before the signal: QEMU stops at once.
            wait_stops(user_dir / "user.sock", PAUSES, RUN_TIMEOUT)
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole process group
            _, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        shutil.rmtree(user_dir, ignore_errors=True)
    assert proc.returncode == 0, err
    # Which of the two ends first is a race: both are a normal end.
    assert err.splitlines()[-1] in (
        f"qmpprof: stopped {QEMU}",
        f"qmpprof: {QEMU} exited (status 0); profiled until then",
    )
    assert gone(pid)
    stacks = samples(out)
    assert f"Samples: {sum(stacks.values())} " in err
    assert WORKLOAD & {name for names in stacks for name in names}, stacks
    assert "Traceback" not in err


@pytest.mark.qemu
@every_qemu
def test_qemu_that_cannot_start_the_guest_is_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    command = [QEMU, "-accel", "tcg", "-kernel", "/nonexistent", "-display", "none"]
    assert main(["record", "--", *command]) == 4
    err = capfd.readouterr().err
    assert "could not open kernel file '/nonexistent'" in err  # QEMU's own word, passed through
    assert err.splitlines()[-1] == (
        f"qmpprof: error: {QEMU} exited (status 1) before the guest started"
    )


@pytest.mark.qemu
@every_qemu
def test_an_unusable_kernel_elf_stops_the_qemu_it_started(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    not_elf = tmp_path / "vmlinux"
    not_elf.write_text("not an ELF file")
    rc = main(["record", "--kernel", str(not_elf), "--", *guest_command(tmp_path)])
    err = capfd.readouterr().err
    assert rc == 6, err
    assert err.splitlines()[-1].startswith(f"qmpprof: error: {not_elf}: not a usable ELF file")
    # QEMU had started (paused); record quit it in order: QEMU deletes its pid file then.
    assert (tmp_path / "console.txt").exists() and not (tmp_path / "qemu.pid").exists()
