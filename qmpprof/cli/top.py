"""``qmpprof top [options]``: a live view of a running guest, as ``top`` and ``py-spy top``
give one: the functions of the last ``--window`` seconds by own and total share, refreshed
every second, with the processes and vCPUs at a glance.

Keys: ``o``/``t`` sort by own/total share; ``k``/``u`` kernel-mode or user-mode samples only,
``a`` all again; ``n`` one process, the next at each press, then all again; ``p`` (or space)
freezes the display while sampling goes on; ``q`` quits, as Ctrl-C does. The terminal and the
guest are left as they were.

Every flag of the profiling command is taken (``--kernel``, ``--user-dir``, ``--interval``,
...); ``-k``/``-u`` choose the first filter. It samples until ``q``, a signal, or
``--duration`` of guest run time (a day by default). ``-o FILE`` writes, on the way out, the
window last shown with its filters: the samples behind the figures on the screen.

The screen is drawn from the sampler's ``on_tick``, right after a tick resumed the guest, so a
refresh's work happens while the guest runs, never inside a pause; and the run forgets samples
older than the window, so its memory does not grow with time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import curses
import dataclasses
import sys
import time
from collections.abc import Iterator
from types import TracebackType

import qmpprof.cli.options as options
import qmpprof.cli.outputs as outputs
from qmpprof import bounds
from qmpprof.cli.options import Options
from qmpprof.errors import UsageError
from qmpprof.guest.base import Guest
from qmpprof.interrupts import interrupts, name
from qmpprof.model import Mode
from qmpprof.output import topview
from qmpprof.output.topview import Filter, Sort, Window
from qmpprof.profile import Profile
from qmpprof.session import Connection, Run, check_socket, load, start
from qmpprof.stats import SamplerStats

WINDOW = 10.0  # seconds of samples shown
REFRESH = 1.0  # seconds between two drawings of the screen
KEYS = "o/t sort own/total  k/u/a kernel/user/all  n next process  p freeze  q quit"


def parser() -> argparse.ArgumentParser:
    p = options.parser()
    p.prog = "qmpprof top"
    p.usage = "%(prog)s [options]"
    p.description = (
        "A live view of a running guest: its functions by own and total share over the last "
        f"--window seconds, refreshed every second. Keys: {KEYS}."
    )
    p.add_argument("--window", metavar="S", type=float, default=WINDOW,
        help="seconds of samples the view shows")  # fmt: skip
    p.set_defaults(duration=bounds.MAX_DURATION)
    return p


def parse(argv: list[str]) -> tuple[Options, Filter, float]:
    """The run's options (the sampler keeps every sample), the view's first filter, its
    window."""
    ns = parser().parse_args(argv)
    if ns.one_shot or ns.json:
        raise UsageError("top shows a run as it goes: --one-shot and --json are the command's")
    seconds = options.checked(bounds.duration, ns.window, "--window")
    opts = options.options_of(ns)
    # -k/-u are the view's first filter, not the sampler's: a key can show the rest.
    sampling = dataclasses.replace(opts.spec.sampling, keep=None)
    spec = dataclasses.replace(opts.spec, sampling=sampling)
    return dataclasses.replace(opts, spec=spec), Filter(mode=options.mode_of(ns)), seconds


def main(argv: list[str]) -> int:
    opts, first, seconds = parse(argv)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("top draws on a terminal; for a file, profile with -o FILE")
    spec = opts.spec
    if spec.reach.transport != "gdb" and spec.reach.qmp_tcp is None:
        check_socket(spec.reach.qmp_socket)
    outputs.check(opts.outputs, opts.fmt)
    options.check_files(spec)
    guest = load(spec)
    return asyncio.run(run(opts, guest, first, seconds))


class Screen:
    """The terminal under curses: keys without echo or Enter, lines drawn whole; Ctrl-C still
    a signal. Left as it was found on exit, whatever ends the run."""

    def __enter__(self) -> Screen:
        self.win = curses.initscr()
        curses.noecho()
        curses.cbreak()
        self.win.nodelay(True)
        with contextlib.suppress(curses.error):  # a terminal without an invisible cursor
            curses.curs_set(0)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        curses.nocbreak()
        curses.echo()
        curses.endwin()

    def keys(self) -> Iterator[str]:
        while (key := self.win.getch()) != -1:
            if 0 <= key < 256:
                yield chr(key)

    def size(self) -> tuple[int, int]:
        height, width = self.win.getmaxyx()
        return width, height

    def draw(self, text: list[str]) -> None:
        self.win.erase()
        width, height = self.size()
        for row, line in enumerate(text[:height]):
            with contextlib.suppress(curses.error):  # the last cell of the screen
                self.win.addnstr(row, 0, line, max(0, width - 1))
        self.win.refresh()


class Live:
    """What the view shows and how the keys change it; draws on ``screen`` after ticks."""

    def __init__(self, opts: Options, shown: Filter, seconds: float) -> None:
        self.opts = opts
        self.filter = shown
        self.seconds = seconds
        self.sort = Sort.OWN
        self.frozen = False
        self.source = Profile()  # the window's samples, kept as they were while frozen
        self.shown: Window | None = None
        self.drawn = 0.0
        self.run: Run | None = None
        self.screen: Screen | None = None

    def key(self, key: str) -> None:
        if key == "q" and self.run is not None:
            self.run.request_stop()
        elif key in "ot":
            self.sort = Sort.OWN if key == "o" else Sort.TOTAL
        elif key in "kua":
            mode = {"k": Mode.KERNEL, "u": Mode.USER}.get(key)
            self.filter = Filter(mode, self.filter.process if mode is not None else None)
        elif key == "n":
            self.filter = Filter(self.filter.mode, self._next_process())
        elif key in "p ":
            self.frozen = not self.frozen

    def _next_process(self) -> str | None:
        names = [n for n, _ in self.shown.processes] if self.shown is not None else []
        if self.filter.process in names:
            at = names.index(self.filter.process) + 1
            return names[at] if at < len(names) else None
        return names[0] if names else None

    def tick(self, stats: SamplerStats) -> None:
        """After a tick, the guest running: keys read, and the screen drawn once a second (at
        once after a key)."""
        pressed = list(self.screen.keys()) if self.screen is not None else []
        for key in pressed:
            self.key(key)
        now = time.monotonic()
        if pressed or now - self.drawn >= REFRESH:
            self.drawn = now
            self.refresh()

    def refresh(self) -> None:
        if self.run is None:
            return
        profile = self.run.profile
        if len(profile):
            profile.forget_before(profile.times[-1] - self.seconds)
        if not self.frozen:
            self.source = topview.latest(profile, self.seconds)
        self.shown = topview.window(
            self.source, self.seconds, self.filter, self.sort, self.opts.naming
        )
        if self.screen is not None:
            width, height = self.screen.size()
            self.screen.draw(topview.lines(self.shown, self.heading(), width, height))

    def heading(self) -> str:
        frozen = "   [frozen: p to go on]" if self.frozen else ""
        return (
            f"qmpprof top - {self.opts.guest}   by {self.sort.value} share   "
            f"{self.filter.label()}{frozen}   keys: {KEYS}"
        )


async def run(opts: Options, guest: Guest, shown: Filter, seconds: float) -> int:
    """Sample ``guest`` until told to stop, the view on the terminal; then ``-o`` written."""
    live = Live(opts, shown, seconds)
    task = asyncio.current_task()

    def first_signal(signum: int) -> None:
        if live.run is not None:
            live.run.request_stop()
        elif task is not None:
            task.cancel()

    with interrupts(first_signal) as caught:
        live.run = await start(opts.spec, on_tick=live.tick, on_connect=_notes, guest=guest)
        try:
            with Screen() as screen:
                live.screen = screen
                live.refresh()
                await live.run.run()
                live.screen = None
                live.refresh()  # the latest window, unless frozen: what -o writes
        finally:
            await live.run.transport.close()
    if caught.signum is not None:
        sys.stderr.write(f"qmpprof: stopped by {name(caught.signum)}\n")
    return _write(opts, live.shown.profile if live.shown is not None else Profile())


def _notes(connection: Connection) -> None:
    """What the connection has to say, before the screen takes the terminal (seen after)."""
    sys.stderr.write("".join(f"qmpprof: note: {note}\n" for note in connection.notes))


def _write(opts: Options, profile: Profile) -> int:
    for path in opts.outputs:
        fmt = outputs.write(profile, path, opts.fmt, opts.naming, sys.stdout)
        sys.stderr.write(
            f"qmpprof: the window last shown ({len(profile)} samples): {path} ({fmt})\n"
        )
    return 0
