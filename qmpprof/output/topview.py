"""The figures of ``qmpprof top``: the latest seconds of a run as functions by own and total
share, the processes and the vCPUs, and that view as lines of text.

A window is a Profile of its own (``latest``), so what the screen shows and
what ``top -o`` writes on quit are one set of samples: a folded file of the window gives the
shares the screen gave. Pure data; the terminal is cli/top.py's.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from qmpprof.model import Mode
from qmpprof.naming import Naming
from qmpprof.profile import Profile


class Sort(enum.Enum):
    OWN = "own"  # samples whose leaf the function is
    TOTAL = "total"  # samples with the function anywhere on the stack


@dataclass(frozen=True, slots=True)
class Filter:
    mode: Mode | None = None  # kernel-mode or user-mode samples only (kernel: kernel frames only)
    process: str | None = None  # one context: a stack's root name, ``name (pid N)`` or ``kernel``

    def label(self) -> str:
        parts = [] if self.mode is None else [f"{self.mode.value} only"]
        if self.process is not None:
            parts.append(self.process)
        return ", ".join(parts) or "all samples"


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    own: int
    total: int


@dataclass(frozen=True, slots=True)
class Window:
    seconds: float  # from its first sample to its last
    profile: Profile  # its samples, after the filter
    rows: tuple[Row, ...]  # sorted as asked
    processes: tuple[tuple[str, int], ...]  # every context in the window, before the process filter
    cpus: tuple[tuple[int, int, int], ...]  # (vCPU, kernel-mode samples, user-mode samples)

    @property
    def samples(self) -> int:
        return len(self.profile)


def latest(profile: Profile, seconds: float) -> Profile:
    """The samples of the last ``seconds`` before ``profile``'s latest one."""
    end = profile.times[-1] if len(profile) else 0.0
    return profile.select(since=end - seconds)


def window(source: Profile, seconds: float, shown: Filter, sort: Sort, naming: Naming) -> Window:
    """``source`` (a window's samples, from ``latest``) as ``shown`` keeps them, counted by
    function; its vCPUs before any filter."""
    kept_mode = source.select(keep=shown.mode) if shown.mode is not None else source
    by_context: Counter[str] = Counter()
    kept: Counter[tuple[str, ...]] = Counter()
    for names, count in kept_mode.named_counts(naming).items():
        by_context[names[0]] += count
        if shown.process is None or names[0] == shown.process:
            kept[names] += count
    chosen = kept_mode
    if shown.process is not None:
        chosen = _only(kept_mode, shown.process, naming)
    return Window(
        seconds=min(seconds, source.times[-1] - source.times[0]) if len(source) else 0.0,
        profile=chosen,
        rows=_rows(kept, sort),
        processes=tuple(sorted(by_context.items(), key=lambda kv: (-kv[1], kv[0]))),
        cpus=_cpus(source),
    )


def _only(profile: Profile, context: str, naming: Naming) -> Profile:
    """``profile``'s samples whose root name is ``context``."""
    named = profile.named(naming)
    return profile.select(where=lambda sid: named[sid].names[0] == context)


def _rows(stacks: Counter[tuple[str, ...]], sort: Sort) -> tuple[Row, ...]:
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for names, count in stacks.items():
        frames = names[1:] or names  # the context is no function; a stack of none is its own
        own[frames[-1]] += count
        for name in set(frames):
            total[name] += count
    first = own if sort is Sort.OWN else total
    then = total if sort is Sort.OWN else own
    order = sorted(total, key=lambda n: (-first[n], -then[n], n))
    return tuple(Row(name, own[name], total[name]) for name in order)


def _cpus(profile: Profile) -> tuple[tuple[int, int, int], ...]:
    modes: Counter[tuple[int, Mode]] = Counter()
    for _, cpu, sid in profile.timeline():
        modes[cpu, profile.stacks[sid].mode] += 1
    return tuple((c, modes[c, Mode.KERNEL], modes[c, Mode.USER]) for c in profile.cpus)


def share(count: int, of: int) -> str:
    """A share in per cent as the screen prints it (one decimal)."""
    return f"{100 * count / of:5.1f}" if of else "  0.0"


def lines(shown: Window, heading: str, width: int, height: int) -> list[str]:
    """The screen: a heading, the vCPUs, the processes, then as many functions as fit."""
    n = shown.samples
    out = [heading[:width]]
    cpus = "  ".join(f"vCPU {c}: {share(k, k + u).strip()}% kernel" for c, k, u in shown.cpus)
    out.append(f"samples {n} in the last {shown.seconds:.1f} s   {cpus}"[:width])
    every = sum(count for _, count in shown.processes)
    procs = "  ".join(f"{name} {share(c, every).strip()}%" for name, c in shown.processes[:8])
    out.append(f"processes: {procs}"[:width])
    out.append("")
    out.append(f"{'OWN%':>6} {'TOTAL%':>6}  FUNCTION"[:width])
    room = max(0, height - len(out) - 1)
    for row in shown.rows[:room]:
        out.append(f"{share(row.own, n):>6} {share(row.total, n):>6}  {row.name}"[:width])
    return out
