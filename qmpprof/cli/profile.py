"""The profiling command (``qmpprof [options]``): connect, sample, write, report.

Everything that must happen on every exit path happens here: SIGINT/SIGTERM only ask the
sampler to stop after its current tick (so the guest is resumed by the code that stopped it),
the output is written atomically whatever ended the run, and the transport is closed.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TextIO

from qmpprof.cli import report
from qmpprof.cli.options import Options
from qmpprof.elf.image import ElfImage
from qmpprof.errors import GuestGoneError
from qmpprof.guest.processes import ProcessTracker
from qmpprof.guest.programs import ProgramIndex
from qmpprof.output import format_for, write_profile
from qmpprof.profile import Naming
from qmpprof.sampler import RunOutcome, Sampler, SamplerConfig, Symbolizer
from qmpprof.stats import SamplerStats
from qmpprof.transport.base import GuestTransport
from qmpprof.transport.qmp import QmpTransport
from qmpprof.unwind.chain import AddressSpace, Module, RawStack, Unwinder

_PROGRESS_EVERY = 0.2  # seconds between progress line updates
_WINDOW = 16384  # stack bytes read at RSP: memsave costs about the same for 4 or 64 KiB
_HMP_WINDOW = 4096  # HMP x is formatting-bound: read less up front, fetch the rest on demand


def build_symbolizer(opts: Options) -> Symbolizer[AddressSpace]:
    """The address spaces to unwind in: the kernel ELF, plus the process running at each sample
    (from the metadata page, else by CR3) with its program's ELF when ``--user-dir`` has it."""
    modules = []
    if opts.kernel is not None:
        modules.append(Module.from_image(ElfImage.load(opts.kernel), kernel=True))
    programs = ProgramIndex.from_dir(opts.user_dir) if opts.user_dir else ProgramIndex([])
    return ProcessTracker(
        modules, programs, metadata_addr=opts.metadata_addr, layout=opts.metadata_layout
    )


async def connect(opts: Options) -> GuestTransport:
    if opts.transport == "gdb":
        from qmpprof.transport.gdb import GdbTransport

        return await GdbTransport.connect(opts.gdb or "")
    if opts.qmp_tcp is not None:
        return await QmpTransport.connect(tcp=opts.qmp_tcp, memory=opts.memory)
    return await QmpTransport.connect(opts.qmp_socket, memory=opts.memory)


def _config(opts: Options, transport: GuestTransport) -> SamplerConfig:
    hmp = isinstance(transport, QmpTransport) and transport.memory == "hmp"
    return SamplerConfig(
        interval=opts.interval_ms / 1e3,
        duration=opts.duration,
        jitter=opts.jitter,
        cpus=opts.cpus,
        window=_HMP_WINDOW if hmp else _WINDOW,
        kernel_boundary=opts.kernel_boundary,
        keep=opts.keep,
    )


class _Interrupts:
    """The first SIGINT/SIGTERM ends the run after the current tick (the guest is resumed by
    the code that stopped it); another one cancels the run, should QEMU stop answering."""

    def __init__(self, request_stop: Callable[[], None]) -> None:
        self.request_stop = request_stop
        self.task = asyncio.current_task()
        self.count = 0

    def __call__(self) -> None:
        self.count += 1
        if self.count == 1:
            self.request_stop()
        elif self.task is not None:
            self.task.cancel()


class _Progress:
    """The live line on stderr: only on a terminal, at most every _PROGRESS_EVERY seconds."""

    def __init__(self, err: TextIO, duration: float) -> None:
        self.err = err
        self.duration = duration
        self.shown = 0.0
        self.active = err.isatty()

    def __call__(self, stats: SamplerStats) -> None:
        now = time.monotonic()
        if self.active and now - self.shown >= _PROGRESS_EVERY:
            self.shown = now
            self.err.write(report.progress_line(stats, self.duration))
            self.err.flush()

    def clear(self) -> None:
        if self.active and self.shown:
            self.err.write("\r\033[K")


async def run(
    opts: Options,
    out: TextIO | None = None,
    err: TextIO | None = None,
    *,
    on_start: Callable[[Sampler[AddressSpace, RawStack]], Awaitable[None]] | None = None,
) -> int:
    """``on_start`` runs once connected, right before sampling (``qmpprof record`` resumes its
    QEMU there, so that sampling begins with the guest's first instruction)."""
    out, err = out or sys.stdout, err or sys.stderr  # looked up now: tests swap sys.stdout
    if opts.output is not None:
        format_for(opts.output, opts.fmt)  # a bad --format fails now, not after the run
    symbolizer = build_symbolizer(opts)  # ELF errors before touching the guest
    transport = await connect(opts)
    try:
        progress = _Progress(err, opts.duration)
        sampler = Sampler(
            transport,
            Unwinder(kernel_boundary=opts.kernel_boundary, lines=opts.lines),
            symbolizer,
            _config(opts, transport),
            Naming(show_addresses=opts.show_addresses, offsets=opts.offsets, lines=opts.lines),
            on_tick=progress,
        )
        loop = asyncio.get_running_loop()
        on_signal = _Interrupts(sampler.request_stop)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal)
        if not opts.one_shot:
            err.write(f"{report.start_line(opts)}\n")
            err.flush()
        started = time.time()
        outcome: RunOutcome | None = None
        try:
            if on_start is not None:
                await on_start(sampler)
            outcome = await sampler.run(one_shot=opts.one_shot)
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            progress.clear()
            _finish(opts, sampler, started, outcome, out, err)
    finally:
        await transport.close()
    return 0


def _finish(
    opts: Options,
    sampler: Sampler[AddressSpace, RawStack],
    started: float,
    outcome: RunOutcome | None,
    out: TextIO,
    err: TextIO,
) -> None:
    """Report and write whatever was collected; runs on every exit path of a run."""
    profile, stats = sampler.profile, sampler.stats
    profile.facts.update(
        {
            "guest": opts.guest,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "samples": str(stats.samples),
            "interval": f"{opts.interval_ms:g} ms",
            "guest run time": f"{stats.run_time:.2f} s",
            "rate": f"{stats.rate_hz():.1f} Hz",
        }
    )
    if opts.kernel is not None:
        profile.facts["kernel"] = opts.kernel.name
    if outcome is not None and not outcome.was_running:
        err.write("qmpprof: the guest is paused: took one sample without resuming it\n")
    if outcome is not None and (opts.one_shot or not outcome.was_running):
        if opts.json:
            out.write(report.one_shot_json(outcome.last))
        else:
            out.write(report.one_shot_text(outcome.last, opts.show_addresses))
    elif opts.output is None:
        out.write(report.top_stacks(profile))
    lines = stats.summary_lines(len(profile.counts()))
    if opts.verbose:
        lines += stats.detail_lines()
    if opts.output is not None:
        fmt = write_profile(profile, opts.output, opts.fmt)
        lines.append(report.written_line(opts.output, fmt))
    err.write("".join(line + "\n" for line in lines))


def gone_message(error: GuestGoneError, output: Path | None) -> str:
    kept = f"; the samples collected so far are in {output}" if output else ""
    return f"{error}{kept}"
