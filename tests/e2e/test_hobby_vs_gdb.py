"""qmpprof's stacks on the teaching-kernel-shaped guests (fixtures/hobby, i386; hobby64, x86_64)
against gdb's, at 100 random moments on every QEMU, loaded as a run loads them: no flag but --kernel
and --user-dir.

gdb interrupts the guest; qmpprof samples it stopped, each of its two vCPUs (vCPU i: gdb's
thread i + 1), and each vCPU's stack is judged against gdb's for that thread. A user-mode
moment: the whole stack, frame for frame (gdb has the program's CFI from -g). A kernel-mode
moment: the kernel frames up to the trap entry ``alltraps``, which no CFI describes: gdb cannot
go past it, so its frames beyond are not compared; nor are the tail-call frames gdb makes up
from DWARF call sites. There qmpprof crosses the trap frame into user code: its first user
frame must be the interrupted pc the kernel itself kept (``cpus[i].proc->tf->eip``, ``->rip``
on x86_64, on vCPU i, read by gdb; test_hobby_describe checks that vCPU i is ``cpus[i]``), and
the walk must reach the program's outermost frame (``_start``).

A moment stopped inside the trap entry (a vector stub, or ``alltraps`` before its call of
``trap``) has its trap frame half built: the frame after the leaf must be at the eip the CPU
pushed, which gdb reads by stepping that vCPU alone to the entry's ``call trap`` and reading
``tf``'s pc there (the entry code's own instructions run in between: nothing changes the
interrupted pc). gdb's stack and kept pc are read on every vCPU before any of them steps.

The second CPU's scheduler was called by ``mpenter``, which the start code (entryother.S,
copied to 0x7000: in no ELF) called: gdb ends those stacks in "??" and so does qmpprof, frame
for frame, with that frame drawn as kernel code (below the kernel boundary, but reached with
no trap frame and in no program). Those moments are counted apart ("from the start code") and
judged by the names, up to the trap entry where there is one.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import capstone
import pytest
from guestvm import free_tcp_port
from hobbyvm import RUST_NAMES, SMP, Hobby, every_hobby, running_hobby
from qemus import every_qemu
from test_unwind_vs_gdb_i386 import I386Oracle

from qmpprof import session
from qmpprof.elf.image import ElfImage
from qmpprof.model import Mode, Sample
from qmpprof.sampler import Sampler, SamplerConfig
from qmpprof.session import RunSpec
from qmpprof.transport.qmp import QmpTransport

pytestmark = [pytest.mark.qemu, every_qemu, every_hobby]

MOMENTS = 100
REQUIRED = 0.97
# Moments where gdb stopped at "??" right after a system-call stub (user/usys.S: no CFI, no
# frame of its own) while qmpprof walked on to _start, or (x86_64) made up a "??" frame there
# before going on as qmpprof did: gdb lost. Since moments in
# the trap entry are judged by the eip the CPU pushed (see the module's docstring), one place
# is left: the stub's "int $64" in user mode. Not judged by gdb; their user frames must be one
# of the programs' own call chains (USER_CHAINS). 17-26 in 100 on both QEMUs with the vector's
# first instruction counted in (TCG stopped the guest there far more often than its three
# instructions' share of the time) on one vCPU; none in 232 vCPU moments, six runs, on two: at
# most 40 in 100 vCPU moments, so that gdb judges the majority.
GDB_LOST_CEILING = 0.40
# The programs' call chains (fixtures/hobby/user/*.c), outermost last: under a system call
# the user frames qmpprof found must be one of these, from the leaf the trap frame gave.
USER_CHAINS = (
    ["work", "main", "_start"],
    ["work", "ask", "chat", "main", "_start"],
    ["sleep", "main", "_start"],
    ["getpid", "main", "_start"],
    ["write", "main", "_start"],
)
_TF = re.compile(r'~"QGTF (-?[0-9a-f]+)\\n"')
_VALUE = re.compile(r'\^done,value="(\d+)"')
# Sourced after the oracle's script: qg_frames again, without gdb's tail-call frames (which it
# makes up from DWARF call-site records; qmpprof does not, on this kernel) and without the frame
# gdb shows for a return address of 0, where it stops (x86_64's boot code pushes one under
# main: nothing called it), and qg_tf.
_TF_SCRIPT = r"""
def qg_frames():
    frame, depth = gdb.newest_frame(), 0
    while frame is not None and depth < 128:
        if depth > 0 and frame.pc() == 0:
            break
        if frame.type() not in (gdb.INLINE_FRAME, gdb.TAILCALL_FRAME):
            name = frame.name()
            if name is None:
                out = gdb.execute("info symbol %#x" % frame.pc(), to_string=True)
                name = "??" if out.startswith("No symbol") else out.split()[0]
            print("QGFRAME %s" % name)
            depth += 1
        try:
            frame = frame.older()
        except gdb.error:
            break
def qg_tf(cpu, cpus, pc):
    try:
        proc = "%s[%d].proc" % (cpus, cpu)
        print("QGTF %x" % int(gdb.parse_and_eval("%s ? %s->tf->%s : 0" % (proc, proc, pc))))
    except gdb.error:
        print("QGTF -1")
"""


class HobbyOracle(I386Oracle):
    def __init__(
        self, hobby: Hobby, kernel: Path, user_dir: Path, port: int, scripts: Path
    ) -> None:
        super().__init__(kernel, user_dir, port, scripts / "qg.py")
        self.hobby = hobby
        self.command("-gdb-set language c")  # a Rust kernel's statics by their quoted names
        (scripts / "qgtf.py").write_text(_TF_SCRIPT)
        self.command(f'-interpreter-exec console "source {scripts / "qgtf.py"}"')
        self.command("-gdb-set scheduler-locking step")  # trap_eip steps one vCPU alone

    def run_to(self, location: str) -> None:
        """Let the stopped guest run on to a temporary breakpoint at ``location``."""
        self.command(f"-break-insert -t {location}")
        lines = self.command("-exec-continue")
        if not any(line.startswith("*stopped") for line in lines):
            self._until(lambda line: line.startswith("*stopped"))

    def select(self, cpu: int) -> None:
        self.command(f"-thread-select {cpu + 1}")

    def trap_eip(self, call: int) -> tuple[int, int]:
        """The pc and cs the CPU pushed for the trap whose entry the selected vCPU stopped in:
        gdb steps that vCPU alone (scheduler-locking; QEMU single-steps with interrupts off, so
        no trap nests) through the entry's straight-line code to its ``call trap`` at ``call``,
        where the ``tf`` argument is (i386: the stack's top; x86_64: rdi), and reads its pc and
        ``cs``."""
        for _ in range(64):  # the longest path: a vector stub's three, alltraps' 17 (x86_64)
            if self.value("$pc") == call:
                tf = self.hobby.trap_frame
                return self.value(f"{tf}->{self.hobby.pc}"), self.value(f"{tf}->cs")
            lines = self.command("-exec-step-instruction")
            if not any(line.startswith("*stopped") for line in lines):
                self._until(lambda line: line.startswith("*stopped"))
        raise AssertionError(f"64 steps never reached the call of trap at {call:#x}")

    def value(self, expression: str) -> int:
        lines = self.command(f'-data-evaluate-expression "(unsigned long long)({expression})"')
        found = [int(m.group(1)) for line in lines for m in [_VALUE.match(line)] if m]
        assert found, lines
        return found[0]

    def user_pc(self, cpu: int) -> int:
        """The user pc the kernel kept for the process ``cpu`` runs (0: none runs)."""
        call = f'qg_tf({cpu}, \\"{self.hobby.names.cpus}\\", \\"{self.hobby.pc}\\")'
        lines = self.command(f'-interpreter-exec console "python {call}"')
        found = [int(m.group(1), 16) for line in lines for m in [_TF.match(line)] if m]
        assert found and found[0] >= 0, lines
        return found[0]


@dataclass(frozen=True, slots=True)
class Seen:
    """What gdb read on one vCPU at a moment, before any of them ran on."""

    theirs: list[str]
    user_pc: int


def seen_on(oracle: HobbyOracle, cpu: int) -> Seen:
    oracle.select(cpu)
    return Seen([plain(name) for name in oracle.stack()], oracle.user_pc(cpu))


def plain(name: str | None) -> str:
    """A function's name without the Rust kernel's crate (gdb names each by its DWARF, qmpprof
    a ``#[no_mangle]`` one by its symbol: ``trap``, ``hobbyrs::trap``)."""
    return (name or "??").removeprefix(RUST_NAMES.namespace)


def kernel_part(names: list[str]) -> list[str]:
    """The frames up to and including the trap entry, where gdb's knowledge ends."""
    return names[: names.index("alltraps") + 1] if "alltraps" in names else names


async def compare(tmp_path: Path, hobby: Hobby) -> tuple[int, list[str], dict[str, int], int]:
    """gdb's and qmpprof's stacks at MOMENTS random moments, then at a stop on each instruction
    of the trap entry (``entry_stops``): the agreeing, the differences, the kinds of moment and
    how many were stopped in the entry on purpose."""
    port = free_tcp_port()
    rng = random.Random(f"qmpprof-{hobby.name}")
    agree, differences = 0, []
    counts = {"user": 0, "kernel": 0, "under a system call": 0, "in the trap entry": 0}
    counts["gdb lost"] = counts["from the start code"] = 0
    with running_hobby(tmp_path, hobby, gdb_port=port) as guest:
        entry = entry_code(guest.kernel_elf)
        spec = RunSpec(kernel=guest.kernel_elf, user_dir=guest.user_dir)
        identifier = session.load(spec)
        unwinder = session.unwinder(spec, identifier)
        assert unwinder.kernel_boundary == hobby.boundary  # kernel.ld
        oracle = HobbyOracle(hobby, guest.kernel_elf, guest.user_dir, port, tmp_path)
        transport = await QmpTransport.connect(guest.qmp_socket)
        stops = entry_stops(guest.kernel_elf, entry, hobby)
        chains = user_chains(guest.user_dir, hobby)
        try:
            for moment in range(1, MOMENTS + len(stops) + 1):
                if moment <= MOMENTS:
                    time.sleep(rng.uniform(0.002, 0.03))
                oracle.stop()
                if moment > MOMENTS:  # random moments seldom land in the entry: a breakpoint
                    oracle.run_to(f"*{stops[moment - MOMENTS - 1]:#x}")
                sampler = Sampler(transport, unwinder, identifier, SamplerConfig())
                outcome = await sampler.run(one_shot=True)
                assert not outcome.was_running
                samples = sorted(outcome.last, key=lambda s: s.cpu)
                assert [s.cpu for s in samples] == list(range(SMP))
                # Before judge: it may step a vCPU on to the call of ``trap``.
                seen = [seen_on(oracle, cpu) for cpu in range(SMP)]
                for sample, truth in zip(samples, seen, strict=True):
                    same, note = judge(sample, truth, oracle, entry, chains)
                    counts[note] += 1
                    agree += same and note != "gdb lost"  # those: judged by USER_CHAINS alone
                    if not same:
                        where = f"moment {moment} cpu {sample.cpu} ({note})"
                        differences.append(f"{where}: {describe(sample, truth.theirs)}")
                oracle.resume()
        finally:
            oracle.close()
            await transport.close()
    return agree, differences, counts, len(stops)


Chains = list[list[str]]
SYSTEM_CALLS = {"work", "sleep", "getpid", "write"}  # fixtures/hobby/user/usys.S


def entry_code(kernel: Path) -> range:
    """The trap entry up to its call of the handler: fixtures/hobby/entry.S lays the vector
    stubs from ``vector0`` on, then ``alltraps``, whose ``call trap`` ends the range."""
    image = ElfImage.load(kernel)
    start, alltraps, trap = (image.symbols.address_of(n) for n in ("vector0", "alltraps", "trap"))
    assert start is not None and alltraps is not None and trap is not None
    code = image.code_at(alltraps, 64)
    assert code is not None
    for end in range(5, len(code)):  # e8 and a displacement from the call's end
        rel = int.from_bytes(code[end - 4 : end], "little", signed=True)
        if code[end - 5] == 0xE8 and alltraps + end + rel == trap:
            return range(start, alltraps + end)
    raise AssertionError("alltraps calls no trap")


def entry_stops(kernel: Path, entry: range, hobby: Hobby) -> list[int]:
    """Each instruction of the timer's and the system call's vector stubs (``vector32``,
    ``vector64``: segments.c) up to their jump, and of ``alltraps`` up to its call."""
    image = ElfImage.load(kernel)
    mode = capstone.CS_MODE_32 if hobby.word == 4 else capstone.CS_MODE_64
    decoder = capstone.Cs(capstone.CS_ARCH_X86, mode)
    found = []
    for name in ("vector32", "vector64", "alltraps"):
        start = image.symbols.address_of(name)
        assert start is not None
        code = image.code_at(start, entry.stop - start if name == "alltraps" else 16)
        assert code is not None
        for addr, _, mnemonic, _ in decoder.disasm_lite(code, start):
            found.append(addr)
            if mnemonic == "jmp":
                break
    return found


def judge(
    sample: Sample, seen: Seen, oracle: HobbyOracle, entry: range, chains: Chains
) -> tuple[bool, str]:
    """Whether qmpprof's stack is gdb's (see the module's docstring), and the kind of moment."""
    frames, theirs = sample.stack.frames, seen.theirs
    ours = [plain(f.symbol) for f in frames]
    if sample.mode is Mode.KERNEL and frames[0].pc in entry:
        oracle.select(sample.cpu)
        eip, cs = oracle.trap_eip(entry.stop - 5)  # entry_code ends after the call's 5 bytes
        crossed = len(frames) > 1 and frames[1].pc == eip and frames[1].kernel == (cs & 3 == 0)
        return crossed and whole_user_chain(sample, chains), "in the trap entry"
    if from_start_code(sample):
        # Up to the trap entry where gdb stops knowing (a trap taken in the scheduler: gdb's
        # "??" past alltraps, qmpprof's crossing its frame into the scheduler), else whole.
        # And that frame is kernel code, where the walk ends whole.
        outermost = frames[-1].kernel and sample.stack.stop.whole
        return kernel_part(ours) == kernel_part(theirs) and outermost, "from the start code"
    if gdb_lost(ours, theirs):
        return in_a_user_chain(sample, chains), "gdb lost"
    if sample.mode is Mode.USER:
        return ours == theirs, "user"
    same = kernel_part(ours) == kernel_part(theirs)
    user = [f for f in sample.stack.frames if not f.kernel]
    if not user:
        return same, "kernel"
    # Crossed into user code: exactly where the kernel says it was, then the whole chain (one
    # of the programs' own under a system call; any reaching _start after a preemption).
    same = same and user[0].pc == seen.user_pc and user[-1].symbol == "_start"
    if user[0].symbol in SYSTEM_CALLS:
        return same and in_a_user_chain(sample, chains), "under a system call"
    return same, "kernel"


def from_start_code(sample: Sample) -> bool:
    """The stack ends in ``mpenter``'s caller, the start code in no ELF (fixtures/hobby/machine.c
    copies entryother.S to 0x7000)."""
    frames = sample.stack.frames
    return len(frames) >= 2 and plain(frames[-2].symbol) == "mpenter" and frames[-1].module is None


def whole_user_chain(sample: Sample, chains: Chains) -> bool:
    """The user frames, if any: a program's call chain under a system call, else down to
    ``_start``; none after a trap in the second CPU's scheduler (``from_start_code``)."""
    user = [f for f in sample.stack.frames if not f.kernel]
    if not user or from_start_code(sample):
        return True
    return (
        in_a_user_chain(sample, chains)
        if user[0].symbol in SYSTEM_CALLS
        else user[-1].symbol == "_start"
    )


def in_a_user_chain(sample: Sample, chains: Chains) -> bool:
    """The user frames are one of the programs' call chains, from some leaf of it on."""
    user = [f.symbol for f in sample.stack.frames if not f.kernel]
    return any(chain[-len(user) :] == user for chain in chains if user)


def user_chains(user_dir: Path, hobby: Hobby) -> Chains:
    """USER_CHAINS as this build runs them: a function whose code is one jump to its callee
    (``ask``'s call of ``work`` at -O2 on x86_64: a tail call) leaves no frame of its own."""
    mode = capstone.CS_MODE_32 if hobby.word == 4 else capstone.CS_MODE_64
    decoder = capstone.Cs(capstone.CS_ARCH_X86, mode)
    names = {name for chain in USER_CHAINS for name in chain}
    jumps = set()
    for elf in sorted(user_dir.glob("*.elf")):
        image = ElfImage.load(elf)
        for name in names:
            at = image.symbols.address_of(name)
            code = None if at is None else image.code_at(at, 16)
            first = next(decoder.disasm_lite(code or b"", at or 0), None)
            if first is not None and first[2] == "jmp":
                jumps.add(name)
    return [[name for name in chain if name not in jumps] for chain in USER_CHAINS]


def gdb_lost(ours: list[str], theirs: list[str]) -> bool:
    """gdb's stack is ours up to a system-call stub, then "??": where it ends (i386), or a
    frame it makes up before going on with ours (x86_64); ours goes on to _start."""
    if ours[-1:] != ["_start"]:
        return False
    for n, name in enumerate(theirs[1:], 1):
        if name == "??" and theirs[:n] == ours[:n] and theirs[n - 1] in SYSTEM_CALLS:
            return n == len(theirs) - 1 or theirs[n + 1 :] == ours[n:]
    return False


def describe(sample: Sample, theirs: list[str]) -> str:
    ours = " ".join(f"{f.symbol or '??'}@{f.pc:#x}" for f in sample.stack.frames)
    return f"gdb {' '.join(theirs)} | qmpprof {ours} [{sample.stack.stop.name}]"


def test_stacks_agree_with_gdb(tmp_path: Path, hobby: Hobby) -> None:
    agree, differences, counts, stops = asyncio.run(compare(tmp_path, hobby))
    judged = SMP * (MOMENTS + stops) - counts["gdb lost"]
    print(f"equal to gdb at {agree} of the {judged} vCPU moments judged; {counts}")
    print("\n".join(differences))
    assert sum(counts.values()) == SMP * (MOMENTS + stops)
    assert counts["gdb lost"] <= GDB_LOST_CEILING * SMP * MOMENTS, "\n".join(differences)
    lost_wrong = [d for d in differences if "(gdb lost)" in d]
    assert not lost_wrong, "not a chain of the programs:\n" + "\n".join(lost_wrong)
    assert agree >= REQUIRED * judged, "\n".join(differences)
    # The moments reach user code and user code under a system call (kernel code alone, the
    # scheduler and the timer, is too brief to be caught every run).
    assert counts["user"] and counts["under a system call"], counts
    assert stops == hobby.entry_steps and counts["in the trap entry"] >= stops, counts
