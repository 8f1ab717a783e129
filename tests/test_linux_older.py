"""Debian's stock older kernels profiled end to end, so that the places where kernels differ
are checked against running ones, not only read offline: bookworm's 6.1 and bullseye's 5.10.
Both have the per-CPU ``current_task`` (6.2 moved it into ``pcpu_hot``) and modules with a
``core_layout`` (6.4: ``mem[]``); 6.1 keeps VMAs in a maple tree (new in 6.1), 5.10 in the
``mm->mmap`` list, and 5.10's BTF has no variables (an older pahole): the current task's
per-CPU offset comes from kallsyms there. Same initramfs as 6.12's guest (tests/linuxvm.py),
with the test module built for each kernel (for 5.10 with the host's gcc-12: bullseye built it
with gcc-10): the whole workload runs on both, module frames read through ``core_layout``.

One ~5 s profile at 10 ms through the command line, KASLR on, 2 vCPUs, then: the slide against
the guest's ``_text``, the ticks sampled, kernel stacks whole, every kernel frame named as the
guest's own /proc/kallsyms names it, processes and threads named, the PIE program's frames named
from --user-dir, and the module's.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from linuxkernel import linux_dir
from linuxvm import ROOTFS, running_linux_guest
from test_linux_names_vs_kallsyms import (
    IMAGE_TEXT,
    NO_TIMER_CHECK,
    REQUIRED,
    GuestNames,
    kernel_names,
)
from test_linux_profile import whole_kernel_part

from qmpprof.cli import main
from qmpprof.model import Mode
from qmpprof.output import native

pytestmark = pytest.mark.qemu

SAMPLED = 0.9  # of the ticks, on each vCPU
WHOLE = 0.95  # of the kernel-mode stacks


@pytest.mark.parametrize("series", ["6.1", "5.10"])
def test_debian_kernel_profiled_from_its_boot_files(
    series: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kernel = linux_dir(series) / "vmlinuz"
    saved = tmp_path / f"linux-{series}.qmpprof"
    with running_linux_guest(
        tmp_path, kaslr=True, smp=2, append=NO_TIMER_CHECK, kernel=kernel
    ) as guest:
        args = ["--qmp-socket", str(guest.qmp_socket), "--kernel", str(kernel)]
        args += ["--user-dir", str(ROOTFS), "--duration", "5", "--interval", "10", "-v"]
        assert main([*args, "-o", str(saved)]) == 0
        console = guest.console_text()
        table = GuestNames(guest.symbols)
        text = guest.symbols.address_of("_text")
        versioned = [guest.symbols.address_of(name) for name in ("current_task", "pcpu_hot")]
    err = capsys.readouterr().err
    print(err, f"boot {guest.boot_seconds:.1f} s")
    # The kernel that ran is older than 6.2: its current task is a per-CPU variable of its own.
    assert versioned[0] is not None and versioned[1] is None, versioned
    assert "qmpprof-linux: insmod failed" not in console, console[-2000:]

    # The slide qmpprof found is where the guest's kallsyms puts _text.
    assert text is not None and text != IMAGE_TEXT, "KASLR did not move the kernel"
    assert f"KASLR slide {text - IMAGE_TEXT:#x}" in err
    # Every layout qmpprof needs (task, module, VMA) found in this kernel's BTF.
    assert "BTF lacks" not in err

    # Nearly every tick sampled, on both vCPUs.
    ticks = int(re.search(r"(\d+) ticks", err).group(1))  # type: ignore[union-attr]
    profile = native.load(saved)
    per_cpu = Counter(cpu for _time, cpu, _sid in profile.timeline())
    print("ticks", ticks, "per vCPU", dict(per_cpu))
    assert sorted(per_cpu) == [0, 1]
    assert all(n >= SAMPLED * ticks for n in per_cpu.values()), (ticks, per_cpu)

    kernel_stacks = whole = 0
    functions: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    threads: set[tuple[str, int | None, str | None]] = set()
    stitched = 0
    stops: Counter[tuple[str, str, str]] = Counter()
    for _time, _cpu, sid in profile.timeline():
        record = profile.stacks[sid]
        frames = profile.frames_of(record)
        functions.update(f"{f.symbol} {f.module_name}" for f in frames)
        names = [f.symbol for f in frames]
        if "entry_SYSCALL_64_after_hwframe" in names:  # the user frames beneath, walked
            stitched += not frames[names.index("entry_SYSCALL_64_after_hwframe") + 1].kernel
        stops[
            (record.process.label if record.process else "", record.mode.name, record.stop.name)
        ] += 1
        if record.process is not None:
            p = record.process
            processes[p.label] += 1
            threads.add((p.label, p.tid, p.thread))
        if record.mode is Mode.KERNEL:
            kernel_stacks += 1
            whole += whole_kernel_part(frames, record.stop)
    print(processes.most_common(), sorted(threads), functions.most_common(30))
    print(stops.most_common())
    print(f"kernel stacks whole: {whole}/{kernel_stacks}, system calls stitched: {stitched}")

    # Kernel stacks walked by ORC down to the entry or the outermost frame.
    assert kernel_stacks > 100
    assert whole >= WHOLE * kernel_stacks, (whole, kernel_stacks)

    # Every kernel frame named as the guest names it.
    equal, total, wrong, _ = kernel_names(profile, table)
    print(f"kernel frames named as the guest's kallsyms: {equal}/{total}")
    print("\n".join(f"{n:5d}  {what}" for what, n in wrong.most_common(20)))
    assert total > 500 and equal >= REQUIRED * total, wrong.most_common(20)

    # System calls (qmpprof-work sys's reads), with the user frames beneath the kernel's.
    assert stitched > 20

    # Processes from task_struct through the per-CPU current_task: the workload (pid, thread)
    # and kernel threads in brackets.
    work = sorted(
        (p for p in processes if re.fullmatch(r"qmpprof-work \(pid \d+\)", p)),
        key=lambda p: -processes[p],
    )  # the user workload first: it computes while the other one sleeps in system calls
    assert work and processes[work[0]] > ticks / 2, processes
    assert any(
        label == work[0] and tid == int(label.split()[-1][:-1]) and thread == "qmpprof-work"
        for label, tid, thread in threads
    ), threads
    assert any(re.fullmatch(r"\[.+\] \(pid \d+\)", p) for p in processes), processes
    # The module's frames, named from its kallsyms in guest memory.
    for name in ("qb_kwork_leaf", "qb_read"):
        assert functions[f"{name} [qmpprof_burn]"] > 0, functions.most_common(40)

    # User frames of the PIE program from its VMAs (a maple tree, or a list) and --user-dir.
    user = [name for name in functions if name.startswith("compute_leaf ")]
    assert user and functions[user[0]] > ticks / 4, functions.most_common(30)
    assert all(functions[f"{name} {user[0].split()[1]}"] > 0 for name in ("compute_middle",
               "compute_outer", "user_loop", "main"))  # fmt: skip
    assert any(name.startswith("__libc_start_main ") for name in functions)
