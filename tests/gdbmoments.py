"""One moment of a stopped guest as qmpprof and gdb each saw it, compared vCPU by vCPU and
counted: the kernel stack frame for frame (``stackverdict.judge``) and the current task
(tests/e2e/test_linux_vs_gdb.py, tests/e2e/test_aarch64_vs_gdb.py)."""

from __future__ import annotations

import bisect
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from linuxgdb import KernelOracle
from stackverdict import judge

from qmpprof.linux.symbols import TEXT_TYPES, KernelSymbols
from qmpprof.model import Mode, Sample, StopReason
from qmpprof.sampler import Sampler
from qmpprof.session import Run


@dataclass(frozen=True, slots=True)
class Observed:
    """What qmpprof says of one vCPU at one moment, from a Sample or from --json."""

    cpu: int
    kernel_mode: bool
    process: tuple[int | None, str | None, int | None, str | None] | None
    kernel_frames: list[tuple[int, str]]  # (address, symbol), leaf first
    ended: bool  # the walk reached the outermost frame or went on into user frames


def observed(sample: Sample) -> Observed:
    p = sample.process
    process = None if p is None else (p.pid, p.program, p.tid, p.thread)
    frames = [(f.pc, f.symbol or "??") for f in sample.stack.frames if f.kernel]
    ended = sample.stack.stop is StopReason.END or len(frames) < len(sample.stack.frames)
    return Observed(sample.cpu, sample.mode is Mode.KERNEL, process, frames, ended)


async def stopped_moment(oracle: KernelOracle, run: Run, rng: random.Random) -> list[Observed]:
    """gdb stops the 2-vCPU guest a random few ms on; qmpprof samples it as it is (a paused
    guest is sampled without stop/cont). The caller compares, then resumes it."""
    time.sleep(rng.uniform(0.005, 0.05))
    oracle.stop_guest()
    return await sampled(run)


async def sampled(run: Run) -> list[Observed]:
    """qmpprof's one-shot of the 2-vCPU guest gdb holds stopped."""
    sampler = Sampler(run.transport, run.unwinder, run.identifier, run.config)
    outcome = await sampler.run(one_shot=True)
    assert not outcome.was_running  # gdb holds the guest: no stop/cont by us
    assert len(outcome.last) == 2, outcome.last
    return [observed(sample) for sample in outcome.last]


class FunctionStarts:
    """The guest's text symbols (its /proc/kallsyms): where the function holding an address
    starts."""

    def __init__(self, symbols: KernelSymbols) -> None:
        self.starts = sorted(
            {a for a, t in zip(symbols.addrs, symbols.types, strict=True) if t in TEXT_TYPES}
        )

    def __call__(self, addr: int) -> int | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        return self.starts[i] if i >= 0 else None


@dataclass
class Tally:
    moments: int = 0
    stacks: int = 0
    equal: int = 0
    allowed: Counter[str] = field(default_factory=Counter)  # stacks, by allowance
    kinds: Counter[str] = field(default_factory=Counter)  # stacks, by kind of allowance
    allowed_stacks: int = 0  # agreeing only with an allowance: neither equal nor different
    frames: int = 0  # gdb's frames compared, all stacks
    tailcalls: int = 0  # of them, gdb's tail-call frames
    crossed: int = 0  # stacks gdb walked on past an exception taken in the kernel
    processes: int = 0
    processes_equal: int = 0
    variables: set[str] = field(default_factory=set)  # where gdb read the current task
    functions: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)  # processes gdb saw
    differences: list[str] = field(default_factory=list)  # stacks that differ, in full
    wrong_processes: list[str] = field(default_factory=list)

    @property
    def judged(self) -> int:
        """The stacks compared whole: equal to gdb's or different (an allowed one is neither)."""
        return self.stacks - self.allowed_stacks

    @property
    def agreeing(self) -> float:
        """The share of the stacks compared whole that are equal to gdb's."""
        return self.equal / max(self.judged, 1)

    def beyond(self, ceilings: dict[str, float]) -> dict[str, int]:
        """The kinds of allowance (stackverdict.KINDS) made on more stacks than their ceiling,
        a share of the moments; each with its count."""
        return {
            kind: self.kinds[kind]
            for kind, ceiling in ceilings.items()
            if self.kinds[kind] > ceiling * self.moments
        }


def describe(frames: list[tuple[int, str]]) -> str:
    return " ".join(f"{name}@{pc:#x}" for pc, name in frames)


def compare_moment(
    oracle: KernelOracle,
    seen: list[Observed],
    where: str,
    starts: FunctionStarts,
    tally: Tally,
    *,
    processes: bool = True,
) -> None:
    """``processes``: compare each vCPU's process too (gdb reads its current task)."""
    tally.moments += 1
    for ours in seen:
        if processes:
            compare_process(oracle, ours, where, tally)
        if not ours.kernel_mode:
            continue
        theirs = oracle.stack(ours.cpu)
        tally.stacks += 1
        tally.frames += len(theirs.frames)
        tally.tailcalls += sum(f.kind == "tailcall" for f in theirs.frames)
        tally.crossed += theirs.crossed > 0
        tally.functions.update(f.symbol for f in theirs.frames)
        verdict = judge(theirs, [pc for pc, _ in ours.kernel_frames], ours.ended, starts)
        if verdict.equal:
            tally.equal += 1
        elif verdict.agrees:
            tally.allowed_stacks += 1
        tally.allowed.update(verdict.allowances)
        tally.kinds.update(verdict.kinds)
        if not verdict.agrees:
            gdb = " ".join(f"{f.symbol}@{f.pc:#x}{'(tc)' * (f.kind == 'tailcall')}"
                           for f in theirs.frames)  # fmt: skip
            tally.differences.append(
                f"{where} cpu {ours.cpu}: {verdict.difference}\n"
                f"  gdb     {gdb} [{theirs.stop}]\n  qmpprof {describe(ours.kernel_frames)}\n"
                + "".join(f"  gdb says: {line}\n" for line in theirs.log)
            )


def compare_process(oracle: KernelOracle, ours: Observed, where: str, tally: Tally) -> None:
    """The vCPU's process, ours against the current task gdb reads."""
    task = oracle.task(ours.cpu)
    want = task.expected()
    tally.processes += 1
    tally.variables.add(task.variable)
    tally.names.add(want[1])
    if ours.process == want:
        tally.processes_equal += 1
    else:
        tally.wrong_processes.append(f"{where} cpu {ours.cpu}: gdb {want} qmpprof {ours.process}")


def summary(tally: Tally) -> str:
    """The counts a test prints, then every difference in full."""
    processes = tally.processes_equal / max(tally.processes, 1)
    return "\n".join([
        f"kernel stacks at {tally.moments} moments: {tally.stacks}; equal to gdb's {tally.equal}"
        f" of the {tally.judged} compared whole ({tally.agreeing:.1%}), {tally.allowed_stacks}"
        f" allowed, {len(tally.differences)} different",
        f"gdb's frames compared: {tally.frames} ({tally.frames / max(tally.stacks, 1):.1f} a"
        f" stack), of them tail-call frames: {tally.tailcalls}; stacks gdb walked on past an"
        f" exception taken in the kernel: {tally.crossed}",
        f"allowances by kind (stacks): {dict(tally.kinds.most_common()) or 'none'}",
        f"allowances (stacks): {dict(tally.allowed.most_common()) or 'none'}",
        f"processes {tally.processes_equal}/{tally.processes} ({processes:.1%}), current task"
        f" read from {sorted(tally.variables)}; seen: {sorted(tally.names)}",
        "gdb's functions: " + " ".join(sorted(tally.functions)),
        *tally.differences,
        *tally.wrong_processes,
    ])  # fmt: skip
