"""The profiling command (``qmpprof [options]``): connect, sample, write, report.

Everything that must happen on every exit path happens here: SIGINT/SIGTERM while connecting
undo what was opened; while sampling they only ask the sampler to stop after its current tick
(so the guest is resumed by the code that stopped it); the output is written atomically
whatever ended the sampling, and the transport is closed.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TextIO

import qmpprof.cli.outputs as outputs
import qmpprof.cli.text as text
from qmpprof.cli.options import Options
from qmpprof.errors import GuestGoneError, OutputError
from qmpprof.guest.base import Guest, TaskLister, Warns
from qmpprof.interrupts import interrupts, name
from qmpprof.model import TaskView
from qmpprof.offcpu import every_task
from qmpprof.output.facts import BOUNDARY_KEY
from qmpprof.sampler import RunOutcome
from qmpprof.session import Connection, Run, start, task_lister
from qmpprof.stats import SamplerStats
from qmpprof.unwind.chain import Unwinder

_PROGRESS_EVERY = 0.2  # seconds between progress line updates


class _Progress:
    """The live line on stderr: only on a terminal, at most every _PROGRESS_EVERY seconds."""

    def __init__(self, err: TextIO, duration: float) -> None:
        self.err = err
        self.duration = duration
        self.shown = 0.0
        self.active = err.isatty()
        self.samples: Callable[[], int] = lambda: 0  # the profile's count, once there is one

    def __call__(self, stats: SamplerStats) -> None:
        now = time.monotonic()
        if self.active and now - self.shown >= _PROGRESS_EVERY:
            self.shown = now
            self.err.write(text.progress_line(stats, self.samples(), self.duration))
            self.err.flush()

    def clear(self) -> None:
        if self.active and self.shown:
            self.err.write("\r\033[K")


async def run(
    opts: Options,
    guest: Guest,
    out: TextIO | None = None,
    err: TextIO | None = None,
    *,
    on_start: Callable[[Run], Awaitable[None]] | None = None,
) -> int:
    """Profile ``guest`` (its files loaded) as ``opts`` say. ``on_start`` runs once connected,
    right before sampling (``qmpprof record`` resumes its QEMU there, so that sampling begins
    with the guest's first instruction).

    Signals (qmpprof.interrupts) are the loop's from before the first byte sent to QEMU until
    the connection is closed: the first one while connecting cancels the start, which undoes
    what it opened in QEMU (then ``Interrupted``: exit 128 + N, nothing written); once a
    sampler exists, it ends sampling after the tick under way, and what was collected is
    written (exit 0); a second one cancels the clean-up (QEMU does not answer)."""
    out, err = out or sys.stdout, err or sys.stderr  # looked up now: tests swap sys.stdout
    progress = _Progress(err, opts.spec.sampling.duration)
    task = asyncio.current_task()
    sampler: Run | None = None

    def connected(connection: Connection) -> None:
        lines = [f"note: {note}" for note in connection.notes]
        if opts.verbose:
            lines += [f"samples travel through {connection.path}", *connection.detail]
        err.write("".join(f"qmpprof: {line}\n" for line in lines))

    def first_signal(signum: int) -> None:
        if sampler is not None:
            sampler.request_stop()
        elif task is not None:
            task.cancel()

    lister = task_lister(guest) if opts.off_cpu else None
    with interrupts(first_signal) as caught:
        sampler = await start(opts.spec, on_tick=progress, on_connect=connected, guest=guest)
        try:
            written = await _sample(opts, sampler, progress, out, err, on_start, lister)
        finally:
            await sampler.transport.close()
        if caught.signum is not None:
            err.write(f"qmpprof: stopped by {name(caught.signum)}\n")
    return written


async def _sample(
    opts: Options,
    sampler: Run,
    progress: _Progress,
    out: TextIO,
    err: TextIO,
    on_start: Callable[[Run], Awaitable[None]] | None,
    lister: TaskLister | None,
) -> int:
    """Sample and write what was collected, whatever ends the run: 0 when it was written;
    raises the first output's error, or GuestGoneError when QEMU went away. With
    ``--off-cpu``, every task of the guest in a pause after the sample's (``lister``)."""
    # What was loaded lives as long as the run: moved out of the collector's sight, so that no
    # full collection walks it inside a pause (one took ~18 ms after a Linux kernel's load).
    gc.collect()
    gc.freeze()
    try:
        progress.samples = lambda: len(sampler.profile)
        if not opts.one_shot:
            err.write(f"{text.start_line(opts)}\n")
            err.flush()
        started = time.time()
        outcome: RunOutcome | None = None
        tasks: list[TaskView] | None = None
        lost: GuestGoneError | None = None
        unwritten: list[OutputError] = []
        try:
            if on_start is not None:
                await on_start(sampler)
            outcome = await sampler.run(one_shot=opts.one_shot)
            if opts.one_shot and opts.off_cpu and lister is not None:
                tasks = await every_task(
                    sampler.transport, lister, sampler.unwinder, sampler.boundary
                )
        except GuestGoneError as gone:
            lost = gone
        finally:
            progress.clear()
            unwritten = _finish(opts, sampler, started, outcome, tasks, out, err)
    finally:
        gc.unfreeze()
    if lost is not None:
        raise GuestGoneError(gone_message(lost, opts.outputs, unwritten)) from lost
    if unwritten:
        raise unwritten[0]
    return 0


def _finish(
    opts: Options,
    sampler: Run,
    started: float,
    outcome: RunOutcome | None,
    tasks: list[TaskView] | None,
    out: TextIO,
    err: TextIO,
) -> list[OutputError]:
    """Report and write whatever was collected; runs on every exit path of a run. Returns the
    outputs that could not be written (the others are written all the same)."""
    profile, stats = sampler.profile, sampler.stats
    profile.facts.update(
        {
            "guest": opts.guest,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "samples": str(len(profile)),
            "interval": f"{opts.spec.sampling.interval * 1e3:g} ms",
            "guest run time": f"{stats.run_time:.2f} s",
            "rate": f"{stats.rate_hz():.1f} Hz",
            BOUNDARY_KEY: f"{sampler.boundary:#x}",
        }
    )
    if opts.spec.kernel is not None:
        profile.facts["kernel"] = opts.spec.kernel.name
    if outcome is not None and not outcome.was_running:
        err.write("qmpprof: the guest is paused: took one sample without resuming it\n")
    if outcome is not None and (opts.one_shot or not outcome.was_running):
        if opts.json:
            out.write(text.one_shot_json(outcome.last, tasks))
        else:
            out.write(text.one_shot_text(outcome.last, opts.naming.show_addresses))
            if tasks is not None:
                out.write(text.tasks_text(tasks, opts.naming.show_addresses))
    elif not opts.outputs:
        out.write(text.top_stacks(profile, opts.naming))
    unique = len(profile.named_counts(opts.naming))
    lines = stats.summary_lines(len(profile), profile.truncated, unique)
    scanned = sampler.unwinder.scanned if isinstance(sampler.unwinder, Unwinder) else 0
    if scanned:
        lines.append(f"Frames found by following code with no CFI to its return: {scanned}")
    if isinstance(sampler.identifier, Warns):
        lines += sampler.identifier.warnings()
    if opts.verbose:
        lines += stats.detail_lines()
    unwritten = []
    for path in opts.outputs:
        try:
            fmt = outputs.write(profile, path, opts.fmt, opts.naming, out)
        except OutputError as error:
            unwritten.append(error)
            continue
        lines.append(text.written_line(path, fmt))
    lines += [f"qmpprof: error: {error}" for error in unwritten[1:]]  # the first ends the run
    err.write("".join(line + "\n" for line in lines))
    return unwritten


def gone_message(
    error: GuestGoneError, outputs: tuple[Path, ...], unwritten: list[OutputError]
) -> str:
    written = [str(path) for path in outputs if path not in {Path(e.path) for e in unwritten}]
    kept = f"; the samples collected so far are in {', '.join(written)}"
    return f"{error}{kept if written else ''}"
