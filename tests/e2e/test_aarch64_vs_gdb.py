"""qmpprof's kernel stacks, frame names and processes against gdb-multiarch's, at random moments
of the aarch64 test guest on bookworm's arm64 6.1 and 6.12 and unstable's 7.x (from 6.13 the
EL1 entry's frame record in pt_regs is zeroed, pt_regs found from its address) (2 vCPUs, KASLR
on, ``-cpu max``, booted with ``arm64.nopauth``: gdb 13.1 cannot strip a kernel return
address's pointer-authentication code, aarch64gdb.py says why).

gdb (``aarch64gdb.Aarch64KernelOracle``: one session on the kernel's -dbg vmlinux moved by the
slide) interrupts the guest at each moment; qmpprof then samples the stopped guest over QMP (a
paused guest is sampled without stop/cont), and for every vCPU, as tests/e2e/test_linux_vs_gdb.py
does on x86_64:

- in kernel mode, gdb's whole stack against qmpprof's, frame for frame (``stackverdict.judge``),
  with only what gdb itself cannot name or reach allowed, each allowance named and counted,
  each kind on at most ALLOWANCE_CEILINGS of the moments, an allowed stack not agreeing;
- the process: gdb's current task (SP_EL0 in the kernel, ``__entry_task`` in user mode);
- every kernel frame's name against the guest's own /proc/kallsyms.

gdb has the test module's symbols too (its .ko at its load address, as on x86_64): the moments
reach its code (cat's reads of /proc/qmpprof_burn, its kernel thread), compared frame for frame
with the rest. 7.x has no test module (``aarch64vm.WITH_MODULE``): its moments are the rest's.

Issue 22 asks for >= 97 % on the stacks and the processes, >= 99 % on the names, over at least
100 moments on each kernel.

Last, gdb stops the guest until both vCPUs are at EL0 and lets it go stopped; ``qmpprof
--one-shot`` then attaches to a guest where no vCPU runs the kernel (issue 35: "no KASLR slide")
and must name each vCPU's process as gdb read it.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from aarch64gdb import NOPAUTH, Aarch64KernelOracle
from aarch64vm import (
    ROOT,
    SERIES,
    WITH_MODULE,
    Aarch64Guest,
    TextSymbols,
    module_ko,
    running_aarch64_guest,
)
from gdbmoments import FunctionStarts, Observed, Tally, compare_moment, stopped_moment, summary
from guestvm import free_tcp_port
from linuxgdb import module_text
from stackverdict import KINDS, STOPS_EARLY

from qmpprof import session
from qmpprof.elf.image import ElfImage
from qmpprof.transport.base import Reach
from qmpprof.transport.qmp import QmpTransport

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

MOMENTS = 100
WORKLOAD = {"head", "xz"}  # the programs of the workload's pipe
REQUIRED = 0.97  # of the stacks compared whole (an allowed one is not), and of the processes
# Each kind of allowance (stackverdict.KINDS: what gdb could not do) on at most this share of
# the moments' stacks. 2 % is asked; gdb stopping early is more common than that whatever
# qmpprof does: gdb cannot leave the interrupt stack (call_on_irq_stack, "previous frame
# identical to this frame"), 16 and 20 stacks in 100 moments measured on 6.1 and 6.12, and 34
# on 6.12 in a fresh-clone CI run: under TCG the share of moments inside interrupts grows as
# the host slows (the guest's timer is tied to host time). Our frames past gdb's stop are not
# checked by gdb; test_aarch64_e2e checks them against the guest's /proc/kallsyms.
ALLOWANCE_CEILINGS = {**dict.fromkeys(KINDS, 0.02), STOPS_EARLY: 0.50}
NAMES_REQUIRED = 0.99
EL0_WAIT = 60.0  # seconds of stops until one finds both vCPUs at EL0


@dataclass
class Names:
    """qmpprof's kernel frames named as the guest's kallsyms name them, of all."""

    frames: int = 0
    right: int = 0
    wrong: list[str] | None = None

    def count(self, text: TextSymbols, seen: list[Observed], where: str) -> None:
        self.wrong = self.wrong or []
        for ours in seen:
            for k, (pc, name) in enumerate(ours.kernel_frames):
                self.frames += 1
                # A caller's frame is named at its call: the return address - 1.
                if name in text.names_at(pc if k == 0 else pc - 1):
                    self.right += 1
                else:
                    self.wrong.append(f"{where} cpu {ours.cpu}: {name}@{pc:#x}")


def check_prerequisites(series: str) -> None:
    """Fail, never skip, when the oracle cannot run (scripts/setup fetches the -dbg vmlinux and
    builds the module where there is one)."""
    if shutil.which("gdb-multiarch") is None:
        pytest.fail("no gdb-multiarch on PATH (scripts/setup installs it)")
    module = [module_ko(series)] if series in WITH_MODULE else []
    for path in (SERIES[series] / "vmlinuz", SERIES[series] / "vmlinux-dbg", *module):
        if not path.is_file():
            pytest.fail(f"{path} is missing: run scripts/setup")


Process = tuple[int, str]  # (tgid, the leader's comm)


async def compare(
    tmp_path: Path, series: str
) -> tuple[Tally, Names, int, list[tuple[Process | None, Process]]]:
    """The tallies, how many of qmpprof's kernel stacks were in the module's code, and each
    vCPU's process at EL0 as a one-shot names it and as gdb reads it (``one_shot_at_el0``)."""
    vmlinux_dbg = SERIES[series] / "vmlinux-dbg"
    rng = random.Random(f"qmpprof-aarch64-vs-gdb-{series}")
    tally, names, in_module = Tally(), Names(), 0
    image_text = ElfImage.load(vmlinux_dbg, mapped=True).section_addr(".text")
    assert image_text is not None
    port = free_tcp_port()
    with running_aarch64_guest(tmp_path, series, append=NOPAUTH, gdb_port=port) as guest:
        stext = guest.symbols.address_of("_stext")
        assert stext is not None
        slide = stext - image_text
        assert slide != 0, "KASLR is on"
        starts = FunctionStarts(guest.symbols)
        text = TextSymbols(guest.symbols)
        oracle = Aarch64KernelOracle(port, vmlinux_dbg, tmp_path / "qg.py", slide)
        try:
            assert oracle.value("&_stext") == stext
            if series in WITH_MODULE:
                ko = module_ko(series)
                oracle.add_module(ko, module_text(guest.symbols, ko))
            while True:  # user-mode moments need what only the kernel maps
                oracle.stop_guest()
                ready = oracle.layout()
                oracle.resume()
                if ready:
                    break
            spec = session.RunSpec(
                reach=Reach(guest.qmp_socket, transport="qmp"), kernel=guest.kernel, os="linux"
            )
            linux = session.load(spec)
            run = await session.start(spec, guest=linux)
            try:
                for moment in range(4 * MOMENTS):
                    # MOMENTS, and more (3 * MOMENTS at most) until the workload's programs were
                    # met: `head` runs briefly, and a loaded host catches it less often (not in
                    # 200 moments of a CI run on 6.1; a moment takes ~0.1 s).
                    if moment >= MOMENTS and tally.names >= WORKLOAD:
                        break
                    seen = await stopped_moment(oracle, run, rng)
                    compare_moment(oracle, seen, f"moment {moment}", starts, tally)
                    names.count(text, seen, f"moment {moment}")
                    in_module += sum(
                        any(name.startswith("qb_") for _, name in ours.kernel_frames)
                        for ours in seen
                    )
                    oracle.resume()
                    # What a run does between ticks, the guest running: what attach could not
                    # read (the linear map, when gdb had stopped every vCPU at EL0) is read.
                    await linux.housekeep()
            finally:
                await run.transport.close()
            at_el0 = await one_shot_at_el0(oracle, guest)
        finally:
            oracle.close()
    return tally, names, in_module, at_el0


async def one_shot_at_el0(
    oracle: Aarch64KernelOracle, guest: Aarch64Guest
) -> list[tuple[Process | None, Process]]:
    """gdb stops the guest until both vCPUs are at EL0, reads their tasks and disconnects, the
    guest left stopped; qmpprof --one-shot (a new process: no slide known) samples it as it
    is. Each vCPU's process, ours and gdb's; the guest runs again after."""
    deadline = time.monotonic() + EL0_WAIT
    while True:  # stop, look, go on: no sleep (two of the workload's loops are in user mode)
        oracle.stop_guest()
        if oracle.levels(2) == [0, 0]:
            break
        oracle.resume()
        assert time.monotonic() < deadline, "never stopped with both vCPUs at EL0"
    theirs = [oracle.task(cpu).expected() for cpu in range(2)]
    oracle.let_go()
    # QEMU has one gdbstub: gdb's, left without a client, is taken down so that qmpprof opens
    # its own (its VBAR_EL1); with it there qmpprof reads through QMP alone.
    control = await QmpTransport.connect(guest.qmp_socket)
    try:
        await control.hmp("gdbserver none")
    finally:
        await control.close()
    run = subprocess.run(
        [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket),
         "--kernel", str(guest.kernel), "--one-shot", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    control = await QmpTransport.connect(guest.qmp_socket)
    try:
        state = await control.status()
        await control.cont()
    finally:
        await control.close()
    assert run.returncode == 0, run.stderr
    assert state != "running", state  # left as it was: stopped
    found = {s["cpu"]: s for s in json.loads(run.stdout)}
    assert sorted(found) == [0, 1] and all(s["mode"] == "user" for s in found.values()), found
    ours = [found[cpu]["process"] for cpu in range(2)]
    return [
        (None if p is None else (p["pid"], p["program"]), (t[0], t[1]))
        for p, t in zip(ours, theirs, strict=True)
    ]


@pytest.mark.parametrize("series", ["6.1", "6.12", "7"])
def test_kernel_stacks_names_and_processes_agree_with_gdb(tmp_path: Path, series: str) -> None:
    check_prerequisites(series)
    started = time.monotonic()
    tally, names, in_module, at_el0 = asyncio.run(compare(tmp_path, series))
    print(f"\nat EL0, each vCPU's process (ours, gdb's): {at_el0}")
    assert all(ours == theirs for ours, theirs in at_el0), at_el0
    processes = tally.processes_equal / max(tally.processes, 1)
    named = names.right / max(names.frames, 1)
    print(
        f"\narm64 {series} (KASLR on), {tally.moments} moments"
        f" in {time.monotonic() - started:.0f} s"
        f"\nkernel frames named as kallsyms: {names.right}/{names.frames} ({named:.1%})"
        f"\nkernel stacks in the module's code: {in_module}"
        f"\n{summary(tally)}"
    )
    print(*(names.wrong or []), sep="\n")
    # The moments reach the workload (its pipe's programs) and both ways to the current task.
    assert tally.names >= WORKLOAD, tally.names
    assert {"SP_EL0", "__entry_task"} <= tally.variables, tally.variables
    # ... and the module's code, which gdb names from the .ko (where there is one).
    if series in WITH_MODULE:
        assert in_module >= 3, in_module
        assert any(function.startswith("qb_") for function in tally.functions), tally.functions
    assert tally.stacks >= MOMENTS // 2
    # Not a vacuous prefix: gdb walks past the leaf. 7.3-9.1 frames a stack measured with the
    # xz workload, 3.1 once on a loaded host (more stops on an entry from user mode: one frame).
    assert tally.frames >= 2 * tally.stacks, tally.frames
    assert not tally.beyond(ALLOWANCE_CEILINGS), summary(tally)
    assert tally.agreeing >= REQUIRED, "\n".join(tally.differences)
    assert named >= NAMES_REQUIRED, names.wrong
    assert processes >= REQUIRED, "\n".join(tally.wrong_processes)
