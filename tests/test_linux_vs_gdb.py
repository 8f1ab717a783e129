"""qmpprof's kernel stacks and processes against gdb's, at random moments of the Linux test guest.

gdb (one long-lived session with Debian's -dbg vmlinux, from scripts/fetch-linux-dbg, through
QEMU's gdbstub; with KASLR on, the symbols moved by the slide the guest printed, ``symbol-file
-o``) is the oracle, on a boot without KASLR and on one with it. At
each moment gdb interrupts the guest; qmpprof then samples the stopped guest over QMP (a paused
guest is sampled without stop/cont), and for every vCPU:

- in kernel mode, gdb's backtrace (its non-inlined frames, through DWARF CFI) against
  qmpprof's kernel frames (ORC), by address: gdb stops at the system call or interrupt entry
  (entry code has no DWARF CFI) where qmpprof goes on through pt_regs, so qmpprof's frames
  must begin with all of gdb's, equal one by one. Both give the leaf's RIP and the callers'
  return addresses (gdb's ``frame.pc()``, qmpprof's ``Frame.pc``);
- the process: gdb reads the vCPU's current task through ``__per_cpu_offset[N]`` and
  ``pcpu_hot.current_task`` with the DWARF types (pid, tgid, flags, comm, the group leader's
  comm); qmpprof's must be the tgid and the leader's comm, ``[comm]`` for a kernel thread,
  ``swapper/N`` (pid 0) for the idle task, and the thread the task's own pid and comm.

The first moments are sampled by the command line (``qmpprof --one-shot --json``, whose
addresses are ``Frame.pc``), the others in-process as session.start builds a run. Issue 11
asks for >= 97 % agreement on each over at least 100 moments.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from guestvm import free_tcp_port
from linuxvm import MODULE, MODULE_KO, ROOT, LinuxGuest, running_linux_guest
from support.bench.gdbcli import GdbMi

from qmpprof import session
from qmpprof.model import Mode, Sample
from qmpprof.sampler import Sampler

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

LINUX = ROOT / "fixtures" / "build" / "linux"
VMLINUZ = LINUX / "vmlinuz"
VMLINUX_DBG = LINUX / "vmlinux-dbg"
MOMENTS = 100
CLI_MOMENTS = 3  # of them, sampled by `qmpprof --one-shot --json` in a subprocess
KERNEL_SPACE = 0xFFFF_8000_0000_0000
IMAGE_TEXT = 0xFFFFFFFF81000000  # _text in Debian's vmlinux (its first LOAD)
REQUIRED = 0.97
PF_KTHREAD = 0x0020_0000
# On a loaded host TCG can fail the kernel's IO-APIC timer check (a panic at boot: "IO-APIC +
# timer doesn't work"): skip the check.
NO_TIMER_CHECK = "no_timer_check"

# Defined once in gdb. Frames: "pc:function" for each frame, newest first, but the inlined
# ones (qmpprof has no DWARF for the kernel); the tail-call frames gdb makes up from DWARF call
# sites count (a function that jumped to another is no longer on the stack: qmpprof finds it
# from the code, qmpprof.unwind.tailcall). gdb's
# frames end at the system call or interrupt entry (the first frame in entry text): entry code
# has no DWARF CFI, and what gdb guesses past it (user addresses, 0) is not a frame. The task:
# numbers, then the two names hex-encoded (a comm may hold any byte).
_SCRIPT = r"""
import gdb

QG_SLIDE = 0

_ENTRY = [int(gdb.parse_and_eval("(unsigned long)&__entry_text_" + e)) for e in ("start", "end")]
_VIRTUAL = (gdb.INLINE_FRAME,)

def _name(frame):
    # The ELF symbol: gdb's DWARF of the relocatable .ko puts qb_init (.init.text) over .text,
    # "info symbol" looks in the address's own section.
    found = gdb.execute("info symbol %#x" % frame.pc(), to_string=True)
    return "??" if found.startswith("No symbol") else found.split()[0]

def qg_frames():
    out, frame = [], gdb.newest_frame()
    while frame is not None and len(out) < 64:
        pc = frame.pc()
        if pc < 0xffff800000000000:
            break
        if frame.type() not in _VIRTUAL:
            out.append("%x:%s" % (pc, _name(frame)))
            if _ENTRY[0] <= pc < _ENTRY[1]:
                break
        try:
            frame = frame.older()
        except gdb.error:
            break
    print("QGFRAMES " + " ".join(out))

def _comm(array):
    return bytes(int(array[i]) & 0xff for i in range(16)).split(b"\0")[0].hex() or "-"

def qg_task(cpu):
    base = int(gdb.parse_and_eval("__per_cpu_offset[%d]" % cpu)) & (2**64 - 1)
    # Per-CPU symbols are offsets (from 0), which KASLR leaves alone; symbol-file -o moved them.
    hot = int(gdb.parse_and_eval("(unsigned long)&pcpu_hot")) - QG_SLIDE
    pointer = "*(struct task_struct **)%#x" % ((base + hot) & (2**64 - 1))
    task = gdb.parse_and_eval(pointer)
    leader = task["group_leader"]
    print("QGTASK %d %d %d %s %s" % (int(task["pid"]), int(task["tgid"]),
        int(task["flags"]) & (2**32 - 1), _comm(task["comm"]), _comm(leader["comm"])))
"""
_FRAMES = re.compile(r'~"QGFRAMES ?(.*)\\n"')
_TASK = re.compile(r'~"QGTASK (\d+) (\d+) (\d+) (\S+) (\S+)\\n"')


@dataclass(frozen=True, slots=True)
class GdbTask:
    pid: int
    tgid: int
    flags: int
    comm: str
    leader_comm: str

    def expected(self) -> tuple[int, str, int, str]:
        """The process qmpprof must name for this task: (pid, name, tid, thread name)."""
        if self.pid == 0:
            return 0, self.comm, 0, self.comm
        if self.flags & PF_KTHREAD:
            return self.tgid, f"[{self.comm}]", self.pid, self.comm
        return self.tgid, self.leader_comm, self.pid, self.comm


def _name(hexed: str) -> str:
    return "" if hexed == "-" else bytes.fromhex(hexed).decode(errors="replace")


class LinuxOracle(GdbMi):
    # Reading the 600 MB vmlinux takes 15-20 s on an idle machine; the first lookups in a
    # compilation unit expand its DWARF, seconds more.
    timeout = 240.0

    def __init__(self, port: int, script: Path, slide: int = 0) -> None:
        """``slide``: the running kernel's KASLR slide, by which gdb moves the symbols."""
        super().__init__(None if slide else str(VMLINUX_DBG))
        if slide:
            self.command(f'-interpreter-exec console "symbol-file -o {slide:#x} {VMLINUX_DBG}"')
        script.write_text(_SCRIPT)
        self.command(f'-interpreter-exec console "source {script}"')
        self.command(f'-interpreter-exec console "python QG_SLIDE = {slide:#x}"')
        self.attach(f"127.0.0.1:{port}")

    def add_module(self, ko: Path, text_addr: int) -> None:
        """The test module's symbols and CFI (its .debug_frame) at its .text's load address.
        Its init and exit code (freed, or never run) go to low addresses no frame has:
        otherwise gdb lays them over .text and names qb_burn_leaf ``qb_init``."""
        away = "-s .init.text 0x1000 -s .exit.text 0x2000"
        self.command(f'-interpreter-exec console "add-symbol-file {ko} {text_addr:#x} {away}"')

    def stop(self) -> None:
        self._interrupt()

    def resume(self) -> None:
        self.command("-exec-continue")

    def frames(self, cpu: int) -> list[tuple[int, str]]:
        """gdb's non-inlined frames of a vCPU, newest first: (pc, function)."""
        self.command(f"-thread-select {cpu + 1}")
        lines = self.command('-interpreter-exec console "python qg_frames()"')
        for line in lines:
            match = _FRAMES.match(line)
            if match:
                pairs = [item.split(":", 1) for item in match.group(1).split()]
                return [(int(pc, 16), name) for pc, name in pairs]
        raise AssertionError(f"gdb printed no frames for cpu {cpu}: {lines}")

    def task(self, cpu: int) -> GdbTask:
        lines = self.command(f'-interpreter-exec console "python qg_task({cpu})"')
        for line in lines:
            match = _TASK.match(line)
            if match:
                pid, tgid, flags, comm, leader = match.groups()
                return GdbTask(int(pid), int(tgid), int(flags), _name(comm), _name(leader))
        raise AssertionError(f"gdb printed no task for cpu {cpu}: {lines}")


def check_prerequisites() -> None:
    """Fetch what is missing the way scripts/setup does (nothing when it is there), and fail,
    never skip, when the oracle still cannot run: the issue wants it in CI."""
    if shutil.which("gdb") is None:
        pytest.fail("no gdb on PATH (scripts/setup installs it)")
    for script, path in (("fetch-linux", VMLINUZ), ("fetch-linux-dbg", VMLINUX_DBG)):
        done = subprocess.run(
            [ROOT / "scripts" / script], stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
        if done.returncode != 0 or not path.is_file():
            pytest.fail(f"{path} is missing and scripts/{script} failed:\n{done.stderr}")


def module_text(guest: LinuxGuest) -> int:
    """Where the module's .text was loaded: a function's address in the guest's /proc/kallsyms
    minus its offset in the .ko (all its functions that stay after init are in .text)."""
    runtime = guest.symbols.address_of("qb_read", MODULE)
    assert runtime is not None, "the guest's kallsyms lack the test module"
    nm = subprocess.run(["nm", str(MODULE_KO)], capture_output=True, text=True, check=True)
    offsets = [
        int(line.split()[0], 16) for line in nm.stdout.splitlines() if line.endswith(" qb_read")
    ]
    assert len(offsets) == 1, offsets
    return runtime - offsets[0]


def kernel_stacks_agree(gdb_pcs: list[int], ours: list[int]) -> bool:
    """qmpprof's kernel frames begin with every one of gdb's frames, address for address."""
    return len(ours) >= len(gdb_pcs) and ours[: len(gdb_pcs)] == gdb_pcs


@dataclass
class Tally:
    stacks: int = 0
    stacks_equal: int = 0
    frames: int = 0  # gdb's frames compared, all stacks
    processes: int = 0
    processes_equal: int = 0
    seen_functions: set[str] | None = None
    seen_processes: set[str] | None = None


def describe(frames: list[tuple[int, str]]) -> str:
    return " ".join(f"{name}@{pc:#x}" for pc, name in frames)


@dataclass(frozen=True, slots=True)
class Observed:
    """What qmpprof says of one vCPU at one moment, from a Sample or from --json."""

    cpu: int
    kernel_mode: bool
    process: tuple[int | None, str | None, int | None, str | None] | None
    kernel_frames: list[tuple[int, str]]  # (address, symbol), leaf first


def observed(sample: Sample) -> Observed:
    p = sample.process
    process = None if p is None else (p.pid, p.program, p.tid, p.thread)
    frames = [(f.pc, f.symbol or "??") for f in sample.stack.frames if f.kernel]
    return Observed(sample.cpu, sample.mode is Mode.KERNEL, process, frames)


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
        found.append(Observed(cpu["cpu"], cpu["mode"] == "kernel", process, kernel))
    return found


def compare_moment(
    oracle: LinuxOracle, seen: list[Observed], where: str, tally: Tally, out: list[str]
) -> None:
    assert tally.seen_functions is not None and tally.seen_processes is not None
    for ours in seen:
        want = oracle.task(ours.cpu).expected()
        tally.processes += 1
        tally.seen_processes.add(want[1])
        if ours.process == want:
            tally.processes_equal += 1
        else:
            out.append(f"{where} cpu {ours.cpu}: process gdb {want} qmpprof {ours.process}")
        if not ours.kernel_mode:
            continue
        theirs = oracle.frames(ours.cpu)
        tally.stacks += 1
        tally.frames += len(theirs)
        tally.seen_functions.update(name for _, name in theirs)
        if kernel_stacks_agree([pc for pc, _ in theirs], [pc for pc, _ in ours.kernel_frames]):
            tally.stacks_equal += 1
        else:
            out.append(
                f"{where} cpu {ours.cpu} ({want[1]}):\n"
                f"  gdb     {describe(theirs)}\n  qmpprof {describe(ours.kernel_frames)}"
            )


def one_shot_json(qmp_socket: Path) -> str:
    """The command line's one-shot sample of the (stopped) guest."""
    cmd = [sys.executable, "-m", "qmpprof", "--qmp-socket", str(qmp_socket)]
    cmd += ["--transport", "qmp", "--kernel", str(VMLINUZ), "--one-shot", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def compare(tmp_path: Path, kaslr: bool) -> tuple[Tally, list[str]]:
    port = free_tcp_port()
    rng = random.Random(f"qmpprof-linux-vs-gdb-{kaslr}")
    tally = Tally(seen_functions=set(), seen_processes=set())
    disagreements: list[str] = []
    with running_linux_guest(
        tmp_path, kaslr=kaslr, smp=2, gdb_port=port, append=NO_TIMER_CHECK
    ) as guest:
        slide = guest.text_address - IMAGE_TEXT
        assert (slide != 0) is kaslr, f"slide {slide:#x}"
        oracle = LinuxOracle(port, tmp_path / "qg.py", slide)
        try:
            oracle.add_module(MODULE_KO, module_text(guest))
            # The first moments through the command line, as a user sees it (QEMU serves one
            # QMP client at a time: before the in-process run opens its connection).
            for moment in range(CLI_MOMENTS):
                time.sleep(rng.uniform(0.005, 0.05))
                oracle.stop()
                seen = observed_json(one_shot_json(guest.qmp_socket))
                assert len(seen) == 2, seen
                compare_moment(oracle, seen, f"cli moment {moment}", tally, disagreements)
                oracle.resume()
            spec = session.RunSpec(
                qmp_socket=guest.qmp_socket, transport="qmp", kernel=VMLINUZ, os="linux"
            )
            run = await session.start(spec)
            try:
                for moment in range(CLI_MOMENTS, MOMENTS):
                    time.sleep(rng.uniform(0.005, 0.05))
                    oracle.stop()
                    sampler = Sampler(run.transport, run.unwinder, run.identifier, run.config)
                    outcome = await sampler.run(one_shot=True)
                    assert not outcome.was_running  # gdb holds the guest: no stop/cont by us
                    assert len(outcome.last) == 2, outcome.last
                    seen = [observed(sample) for sample in outcome.last]
                    compare_moment(oracle, seen, f"moment {moment}", tally, disagreements)
                    oracle.resume()
            finally:
                await run.transport.close()
        finally:
            oracle.close()
    return tally, disagreements


@pytest.mark.parametrize("kaslr", [False, True], ids=["nokaslr", "kaslr"])
def test_kernel_stacks_and_processes_agree_with_gdb(tmp_path: Path, kaslr: bool) -> None:
    check_prerequisites()
    tally, disagreements = asyncio.run(compare(tmp_path, kaslr))
    stacks = tally.stacks_equal / max(tally.stacks, 1)
    processes = tally.processes_equal / max(tally.processes, 1)
    print(
        f"\nkernel stacks: qmpprof agrees with gdb on {tally.stacks_equal}/{tally.stacks}"
        f" ({stacks:.1%}); processes {tally.processes_equal}/{tally.processes}"
        f" ({processes:.1%})\nprocesses seen: {sorted(tally.seen_processes or ())}"
    )
    print(
        f"gdb's frames compared: {tally.frames} ({tally.frames / max(tally.stacks, 1):.1f} a stack)"
    )
    print("gdb's functions:", " ".join(sorted(tally.seen_functions or ())))
    print("\n".join(disagreements))
    # The moments must reach the workload's kernel paths: the module's system call and thread.
    seen = sorted(tally.seen_functions or ())
    assert {"qb_burn_leaf", "qb_kwork_leaf"} <= set(seen), seen
    assert {"qmpprof-work", "[qmpprof_kwork]"} <= (tally.seen_processes or set())
    assert tally.stacks >= MOMENTS // 2
    # Not a vacuous prefix: gdb walks well past the leaf (the syscall path is 9 frames deep).
    assert tally.frames >= 4 * tally.stacks, tally.frames
    assert stacks >= REQUIRED, "\n".join(disagreements)
    assert processes >= REQUIRED, "\n".join(disagreements)
