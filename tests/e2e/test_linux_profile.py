"""A stock Linux guest profiled end to end from the files in /boot alone, on every kernel the tests
boot: Debian's 5.10, 6.1 and 6.12 and unstable's 7.x, each booted with KASLR on 2 vCPUs
(tests/linuxvm.py). The workload: a PIE program linked with glibc (user compute, and pread() on
the test module's /proc file, which burns CPU in the module), the module's kernel thread, and
Debian's xz (a PIE whose work is done in liblzma.so.5, both stripped but for .dynsym, with
.eh_frame).

One boot per kernel (``profiled``), one 5 s profile at 10 ms through the command line with the
default transport, saved as a .qmpprof; then checked against the guest's own word:

- the run: the KASLR slide (the guest's ``_text`` - the image's), the kernel's vmcoreinfo
  line, no notes; the ticks sampled on both vCPUs; kernel stacks whole and named; the module's
  frames named; system calls stitched to the user code that made them; user frames named
  from --user-dir (on 6.12 from --initrd, the initramfs the guest booted); processes and
  threads named;
- every kernel frame named as the guest's /proc/kallsyms names it;
- xz's user frames: in the file its /proc/PID/maps maps there, at that file's offset, and
  named only by a .dynsym symbol of that file covering the address.

And, on 6.12 only (what it checks does not depend on the kernel): a module loaded while
qmpprof runs, its frames named from then on.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import linuxkernel
import pytest
from guestvm import free_tcp_port, run_state, set_running
from linuxframes import GuestNames, check_user_frames, kernel_names, whole_kernel_part
from linuxkernel import linux_dir
from linuxvm import BUILD, ROOTFS, Mapping, running_linux_guest, wait_console
from qmpevents import wait_stops
from sharedlinux import Shared, lent

from qmpprof.linux import initramfs
from qmpprof.model import Mode
from qmpprof.output import native
from qmpprof.profile import Profile

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

MODULE = "[qmpprof_burn]"
SAMPLED = 0.9  # of the ticks, on each vCPU
WHOLE = 0.95  # of the kernel-mode stacks
NAMED = 0.99  # of the kernel frames, as the guest's kallsyms
PLACED = 0.95  # of xz's user frames, in the right file at the right offset
# qmpprof's ticks after the late module's load before the run is stopped: what a fixed 10 s gave
# at 32 Hz wall (measured on a loaded 2-core host); a slower host waits longer, not checks less.
LATE_TICKS = 320
# qmpprof's ticks before the test tells the guest to load the module: it samples a guest
# without it first (its module list is read at attach; the ticks show it past that).
EARLY_TICKS = 32
LATE_WAITING = "qmpprof-linux: waiting for the word to load the module"

INITRD = BUILD / "initramfs.cpio.gz"  # what the guest boots (scripts/run-linux-guest)


@dataclass(frozen=True, slots=True)
class Profiled:
    """One kernel's boot and profile, and what the guest said of itself meanwhile."""

    series: str
    release: str  # the kernel's version file
    image_text: int  # _text in the image (its .text)
    guest_text: int  # _text in the guest's /proc/kallsyms
    err: str  # qmpprof's standard error (-v)
    profile: Profile
    names: GuestNames  # the guest's /proc/kallsyms
    xz_pid: int
    xz_maps: list[Mapping]
    boot_seconds: float
    run_seconds: float  # qmpprof's whole run, load and attach included

    @property
    def ticks(self) -> int:
        return int(re.search(r"(\d+) ticks", self.err).group(1))  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def profiled(kaslr_boot: Shared, tmp_path_factory: pytest.TempPathFactory) -> Profiled:
    """A 5 s qmpprof run on the shared KASLR guest of each series (tests/sharedlinux.py)."""
    series = kaslr_boot.series
    folder = linux_dir(series)
    vmlinuz = folder / "vmlinuz"
    tmp = tmp_path_factory.mktemp(f"linux-{series}")
    saved = tmp / "profile.qmpprof"
    with lent(kaslr_boot) as shared:
        guest = shared.guest
        cmd = [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket)]
        # The user programs: the rootfs folder, or on 6.12 the initramfs the guest booted
        # (the same files, which qmpprof unpacks itself), so that both ways are checked.
        files = ["--initrd", str(INITRD)] if series == "6.12" else ["--user-dir", str(ROOTFS)]
        cmd += ["--kernel", str(vmlinuz), *files]
        cmd += ["--duration", "5", "--interval", "10", "-v", "-o", str(saved)]
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        run_seconds = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        guest_text = guest.symbols.address_of("_text")
        xz_pid, xz_maps = guest.xz_maps()
        names = GuestNames(guest.symbols)
    image_text = linuxkernel.vmlinux(series).section_addr(".text")
    assert guest_text is not None and image_text is not None
    print(f"\n{series}: boot {guest.boot_seconds:.1f} s, qmpprof {run_seconds:.1f} s")
    print(done.stderr)
    return Profiled(
        series,
        (folder / "version").read_text().strip(),
        image_text,
        guest_text,
        done.stderr,
        native.load(saved),
        names,
        xz_pid,
        xz_maps,
        guest.boot_seconds,
        run_seconds,
    )


def test_profiled_from_its_boot_files(profiled: Profiled) -> None:
    err, profile, ticks = profiled.err, profiled.profile, profiled.ticks
    # The slide qmpprof found is where the guest's kallsyms puts _text.
    slide = profiled.guest_text - profiled.image_text
    assert slide != 0, "KASLR did not move the kernel"
    assert f"KASLR slide {slide:#x}," in err, err
    # The running kernel's vmcoreinfo confirms the image: its release, symbols at the slide.
    wanted = rf"^qmpprof: vmcoreinfo: Linux {re.escape(profiled.release)}, (\d+) symbols confirmed$"
    confirmed = re.search(wanted, err, re.M)
    assert confirmed is not None and int(confirmed.group(1)) > 0, err
    # Nothing the user must be told: every layout found, every check passed.
    assert [line for line in err.splitlines() if "note:" in line] == [], err

    # Nearly every tick sampled, on both vCPUs.
    per_cpu = Counter(cpu for _time, cpu, _sid in profile.timeline())
    print("ticks", ticks, "per vCPU", dict(per_cpu))
    assert sorted(per_cpu) == [0, 1]
    assert all(n >= SAMPLED * ticks for n in per_cpu.values()), (ticks, per_cpu)

    kernel_stacks = whole = stitched = 0
    functions: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    threads: set[tuple[str, int | None, str | None]] = set()
    stops: Counter[tuple[str, str, str]] = Counter()
    for _time, _cpu, sid in profile.timeline():
        record = profile.stacks[sid]
        frames = profile.frames_of(record)
        functions.update(f"{f.symbol} {f.module_name}" for f in frames)
        names = [f.symbol for f in frames]
        if "entry_SYSCALL_64_after_hwframe" in names:  # the pread()s, down to _start
            user = names[names.index("entry_SYSCALL_64_after_hwframe") + 1 :]
            stitched += "read_burn" in user and "_start" in user
        label = record.process.label if record.process else ""
        stops[(label, record.mode.name, record.stop.name)] += 1
        if record.process is not None:
            p = record.process
            processes[p.label] += 1
            threads.add((p.label, p.tid, p.thread))
        if record.mode is Mode.KERNEL:
            kernel_stacks += 1
            whole += whole_kernel_part(frames, record.stop)
    print(processes.most_common(), sorted(threads), functions.most_common(30), sep="\n")
    print(stops.most_common())
    print(
        f"{profiled.series}: kernel stacks whole {whole}/{kernel_stacks}"
        f" ({whole / max(kernel_stacks, 1):.1%}), system calls stitched {stitched}"
    )

    # Kernel stacks walked by ORC down to the entry or the outermost frame, every frame named.
    assert kernel_stacks > 100
    assert whole >= WHOLE * kernel_stacks, (whole, kernel_stacks)
    # The module's code on the system call path and in its kernel thread, named from its
    # kallsyms in guest memory.
    for name, least in (("qb_read", 20), ("qb_burn_leaf", 20), ("qb_kwork_leaf", 5)):
        assert functions[f"{name} {MODULE}"] > least, functions.most_common(40)
    # pread() from the PIE program, with the user frames beneath the kernel's.
    assert stitched > 20
    # User frames named from --user-dir: the PIE program's and libc's functions.
    leaves = [name for name in functions if name.startswith("compute_leaf ")]
    assert leaves and functions[leaves[0]] > ticks / 4, functions.most_common(30)
    program = leaves[0].split()[1]
    for name in ("compute_middle", "compute_outer", "user_loop", "main"):
        assert functions[f"{name} {program}"] > 0, name
    assert any(name.startswith("__libc_start_main ") for name in functions)

    # Processes from task_struct through the per-CPU current task: the workload (pid, thread)
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
    assert any(re.fullmatch(r"\[qmpprof_kwork\] \(pid \d+\)", p) for p in processes), processes
    assert f"xz (pid {profiled.xz_pid})" in processes, processes


def test_kernel_frames_named_as_the_guests_kallsyms(profiled: Profiled) -> None:
    """Every kernel frame's name against the guest's /proc/kallsyms (runtime addresses under
    KASLR, the module's symbols included): the greatest text symbol at or below the address
    (the leaf's RIP; for callers the call before the return address), any alias there."""
    equal, total, wrong, names = kernel_names(profiled.profile, profiled.names)
    share = equal / max(total, 1)
    print(f"\n{profiled.series}: kernel frames named as the guest's kallsyms {equal}/{total}"
          f" ({share:.2%})")  # fmt: skip
    print("most frequent:", names.most_common(12))
    print("\n".join(f"{n:5d}  {what}" for what, n in wrong.most_common(20)))
    assert total > 500
    # The module's frames among them: its symbols come from guest memory.
    assert "qb_burn_leaf" in names and "qb_kwork_leaf" in names, names.most_common(30)
    assert share >= NAMED, wrong.most_common(20)


def test_xz_frames_in_their_files_named_by_their_dynsym(profiled: Profiled) -> None:
    """xz (a PIE) and liblzma.so.5 are mapped where the loader put them: each user frame of xz
    must be in the file its /proc/PID/maps has there, at that file's offset; and with neither
    file keeping a .symtab, a frame is named only by a .dynsym symbol covering its address
    (liblzma's internal functions are ``[unknown]``, not the exported one below them)."""
    # On 6.12 qmpprof took the files from the initramfs, unpacked where this finds it again.
    taken = initramfs.unpacked(INITRD) if profiled.series == "6.12" else None
    found = check_user_frames(profiled.profile, profiled.xz_pid, profiled.xz_maps, ROOTFS, taken)
    placed = found.placed / max(found.total, 1)
    print(
        f"\n{profiled.series}: xz's user frames in the right file at the right offset"
        f" {found.placed}/{found.total} ({placed:.1%}), by file {dict(found.files)};"
        f" named {found.named}, by a covering .dynsym symbol {found.named_right}"
    )
    print("names:", found.names.most_common(12))
    print("\n".join(f"{n:5d}  {what}" for what, n in found.wrong.most_common(20)))
    assert found.total >= 50, found.total  # xz ran (~3 % of the samples, several frames each)
    assert {"/usr/bin/xz", "/lib/x86_64-linux-gnu/liblzma.so.5.4.1"} <= set(found.files)
    assert placed >= PLACED, found.wrong.most_common(20)
    assert found.named_right == found.named, found.wrong.most_common(20)
    assert found.named > 0  # lzma_code and its like: liblzma's exported entry points


def test_a_module_loaded_during_the_run_is_named(tmp_path: Path) -> None:
    """The guest loads the module (and starts the workload reading it) when the test says so,
    after the rest of its workload (init's ``qmpprof.late_module``, told over COM3): once
    qmpprof has sampled EARLY_TICKS times without it. qmpprof must name the module's frames
    once it is loaded. Stopped by SIGINT once it has sampled LATE_TICKS times after the load
    (the witness socket's STOP events)."""
    saved = tmp_path / "late.qmpprof"
    kernel = linux_dir("6.12") / "vmlinuz"
    with running_linux_guest(
        tmp_path,
        kaslr=True,
        smp=2,
        dump_kallsyms=False,
        append="qmpprof.late_module",
        witness=True,
        go=True,
    ) as guest:
        assert guest.witness_socket is not None
        wait_console(guest, LATE_WAITING, 60)  # init holds COM3 open: the word cannot be lost
        cmd = [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket)]
        cmd += ["--kernel", str(kernel), "--user-dir", str(ROOTFS), "--duration", "600"]
        cmd += ["--interval", "20", "-v", "-o", str(saved)]
        run = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        try:
            wait_stops(guest.witness_socket, EARLY_TICKS, 180)
            assert run.poll() is None, run.communicate()[1]
            guest.send_go()
            deadline = time.monotonic() + 60
            while "module loaded late" not in guest.console_text():
                assert time.monotonic() < deadline, guest.console_text()[-2000:]
                assert run.poll() is None, run.communicate()[1]
                time.sleep(0.1)
            wait_stops(guest.witness_socket, LATE_TICKS, 180)
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
    burn, kwork = functions[f"qb_burn_leaf {MODULE}"], functions[f"qb_kwork_leaf {MODULE}"]
    print(functions.most_common(30), f"qb_burn_leaf {burn}, qb_kwork_leaf {kwork}")
    assert burn > 20 and kwork > 5
    # From the first sample that names the module on, its frames are named: unnamed kernel
    # frames there would be the module's, unknown (or an unwinding fault; the 6.12 run has none).
    first = min(t for t, named, _ in samples if named)
    assert any(t < first for t, _, _ in samples)  # sampled before the load too
    after = [unnamed for t, _, unnamed in samples if t > first]
    assert sum(after) <= 0.02 * len(after), (sum(after), len(after))


def test_the_vms_own_gdbstub_with_qmp_beside_it_samples_as_qmp_does(tmp_path: Path) -> None:
    """A VM started with -gdb has its gdbstub already: no private one opens (qmpprof samples
    over QMP alone then). ``--gdb`` with ``--qmp-socket`` samples through that stub, QMP beside
    it reading what Linux needs while the guest runs (its slide, tasks, modules). Paused, a
    one-shot through the stub and one over QMP alone see the same moment: the same stacks,
    address for address, under the same processes; a sampling run through the stub leaves the
    guest running, its samples under named processes."""
    port = free_tcp_port()
    kernel = linux_dir("6.12") / "vmlinuz"
    with running_linux_guest(
        tmp_path, kaslr=True, smp=2, gdb_port=port, dump_kallsyms=False
    ) as guest:
        base = [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket)]
        base += ["--kernel", str(kernel)]
        stub = ["--gdb", f"127.0.0.1:{port}"]
        set_running(guest.qmp_socket, False)
        try:
            seen = []
            for way in (stub, ["--transport", "qmp"]):
                run = subprocess.run(
                    [*base, *way, "--one-shot", "--json"],
                    capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                )  # fmt: skip
                assert run.returncode == 0, run.stderr
                seen.append([
                    (s["cpu"], s["process"], [f["address"] for f in s["frames"]])
                    for s in json.loads(run.stdout)
                ])  # fmt: skip
            assert seen[0] == seen[1] and len(seen[0]) == 2, seen
            assert run_state(guest.qmp_socket) == "paused"
        finally:
            set_running(guest.qmp_socket, True)
        folded = tmp_path / "stub.folded"
        run = subprocess.run(
            [*base, *stub, "--duration", "1", "-o", str(folded)],
            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert run_state(guest.qmp_socket) == "running"
        lines = folded.read_text().splitlines()
        samples = sum(int(line.rsplit(" ", 1)[1]) for line in lines)
        unnamed = sum(int(line.rsplit(" ", 1)[1]) for line in lines if "(pid " not in line)
        assert samples >= 100 and unnamed <= samples // 20, (samples, unnamed, run.stderr)
