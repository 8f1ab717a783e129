"""A stock Linux guest profiled end to end from the files in /boot alone: Debian's 6.12 kernel
booted with KASLR on 2 vCPUs (tests/linuxvm.py), its workload a PIE program linked with glibc
(user compute, and pread() on the test module's /proc file, which burns CPU in the module) and
the module's kernel thread. One 5 s profile at 10 ms, saved as a .qmpprof, then checked: the
ticks sampled, kernel stacks whole and named, module frames named, system calls stitched to the
user code that made them, user frames named from --user-dir, processes named. And a module
loaded while qmpprof runs: its frames named from then on."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from linuxvm import BUILD, ROOTFS, running_linux_guest

from qmpprof.cli import main
from qmpprof.model import Frame, Mode, StopReason
from qmpprof.output import native

pytestmark = pytest.mark.qemu

KERNEL = BUILD.parent / "linux" / "vmlinuz"
MODULE = "[qmpprof_burn]"
ENTRIES = ("entry_SYSCALL_64", "asm_", "ret_from_fork", "common_startup_64", "secondary_startup")


def whole_kernel_part(frames: list[Frame], stop: StopReason) -> bool:
    """The kernel frames of a kernel-mode stack are whole: every one named, and the walk went
    on into the user code beneath (a system call or an interrupt of user code) or ended at the
    outermost kernel frame (a kernel thread's or the idle loop's entry)."""
    kernel = [f for f in frames if f.kernel]
    if not kernel or any(f.symbol is None for f in kernel):
        return False
    if len(kernel) < len(frames):  # user frames follow: the entry was crossed
        return True
    outermost = kernel[-1].symbol or ""
    return stop is StopReason.END and outermost.startswith(ENTRIES)


def test_a_kaslr_guest_profiled_from_its_boot_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "linux.qmpprof"
    with running_linux_guest(tmp_path, kaslr=True, smp=2, dump_kallsyms=False) as guest:
        args = ["--qmp-socket", str(guest.qmp_socket), "--kernel", str(KERNEL)]
        args += ["--user-dir", str(ROOTFS), "--duration", "5", "--interval", "10", "-v"]
        assert main([*args, "-o", str(saved)]) == 0
        slide = guest.text_address - 0xFFFF_FFFF_8100_0000
    err = capsys.readouterr().err
    print(err)
    assert f"KASLR slide {slide:#x}" in err and slide != 0
    ticks = int(re.search(r"(\d+) ticks", err).group(1))  # type: ignore[union-attr]
    profile = native.load(saved)
    assert len(profile) >= 0.9 * 2 * ticks  # both vCPUs, nearly every tick

    kernel_stacks = whole = 0
    functions: Counter[str] = Counter()
    processes: set[str] = set()
    stitched = 0
    for _time, _cpu, sid in profile.timeline():
        record = profile.stacks[sid]
        frames = profile.frames_of(record)
        if record.process is not None:
            processes.add(record.process.label)
        functions.update(f"{f.symbol} {f.module_name}" for f in frames)
        names = [f.symbol for f in frames]
        if "entry_SYSCALL_64_after_hwframe" in names:
            user = names[names.index("entry_SYSCALL_64_after_hwframe") + 1 :]
            stitched += "read_burn" in user and "_start" in user
        if record.mode is Mode.KERNEL:
            kernel_stacks += 1
            whole += whole_kernel_part(frames, record.stop)
    print(sorted(processes), functions.most_common(30))
    assert kernel_stacks > 100
    assert whole >= 0.95 * kernel_stacks, (whole, kernel_stacks)
    # The module's code on the system call path and in its kernel thread, named.
    assert functions[f"qb_burn_leaf {MODULE}"] > 20 and functions[f"qb_kwork_leaf {MODULE}"] > 5
    # pread() from the PIE program, with the user frames beneath the kernel's.
    assert stitched > 20
    # User code named from --user-dir: the PIE program's and libc's functions.
    program = next(name for name in functions if name.startswith("compute_leaf "))
    assert functions[program] > 20
    assert any(name.startswith("__libc_start_main ") for name in functions)
    assert any(p.startswith("qmpprof-work (pid ") for p in processes), processes
    assert any(p.startswith("[qmpprof_kwork] (pid ") for p in processes), processes


def test_a_module_loaded_during_the_run_is_named(tmp_path: Path) -> None:
    """The guest loads the module (and starts the workload reading it) 20 s after the rest of
    its workload (init's ``qmpprof.late_module``): qmpprof, started before that, must name the
    module's frames once it is loaded. Stopped by SIGINT 10 s after the load."""
    saved = tmp_path / "late.qmpprof"
    with running_linux_guest(
        tmp_path, kaslr=True, smp=2, dump_kallsyms=False, append="qmpprof.late_module"
    ) as guest:
        cmd = [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket)]
        cmd += ["--kernel", str(KERNEL), "--user-dir", str(ROOTFS), "--duration", "600"]
        cmd += ["--interval", "20", "-v", "-o", str(saved)]
        run = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            while "module loaded late" not in guest.console_text():
                assert time.monotonic() < deadline, guest.console_text()[-2000:]
                assert run.poll() is None, run.communicate()[1]
                time.sleep(0.5)
            time.sleep(10)
            run.send_signal(signal.SIGINT)
            _, err = run.communicate(timeout=120)
        finally:
            run.kill()
    print(err)
    assert run.returncode == 0, err
    assert "0 modules (none)" in err  # not loaded when the run started
    functions: Counter[str] = Counter()
    samples = []  # (time, a module frame named, a kernel frame unnamed)
    profile = native.load(saved)
    for time_, _cpu, sid in profile.timeline():
        frames = profile.frames_of(profile.stacks[sid])
        functions.update(f"{f.symbol} {f.module_name}" for f in frames)
        named = any(f.module_name == MODULE and f.symbol for f in frames)
        samples.append((time_, named, any(f.kernel and f.symbol is None for f in frames)))
    print(functions.most_common(30))
    assert functions[f"qb_burn_leaf {MODULE}"] > 20 and functions[f"qb_kwork_leaf {MODULE}"] > 5
    # From the first sample that names the module on, its frames are named: unnamed kernel
    # frames there would be the module's, unknown (or an unwinding fault; the 6.12 run has none).
    first = min(t for t, named, _ in samples if named)
    after = [unnamed for t, _, unnamed in samples if t > first]
    assert sum(after) <= 0.02 * len(after), (sum(after), len(after))
