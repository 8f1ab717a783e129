"""qmpprof's kernel stack against gdb's, frame for frame: equal, equal but for what gdb itself
cannot name or reach (each such allowance named), or different.

Equal: qmpprof's frames begin with all of gdb's non-inlined frames, tail-call frames included,
address for address, and gdb walked down to the system call or interrupt entry. The only
allowances, each a sentence saying what gdb could not do:

- gdb stopped before the entry (``gdb stops at F: <its error>``: it cannot unwind off the
  IRQ stack, where qmpprof goes on through the saved stack pointer) and qmpprof walked on;
- gdb walked on past qmpprof's outermost frame (``gdb walks on past F``), where qmpprof's
  walk ended (END: ``ret_from_fork`` and its like, whose ORC says the stack ends there);
- tail-call frames qmpprof made that gdb lacks, where gdb's own ``set debug entry-values``
  output at that moment says why it could not make them between that callee and caller
  (``gdb cannot make a tail-call frame: <why>``).

Each allowance is of one of three kinds (KINDS), which the oracle tests count and cap; an
allowed stack is neither equal nor different. Anything else is a difference: a frame of gdb's
qmpprof lacks (a tail-call frame, say), one qmpprof has that gdb does not explain, a different
address, or qmpprof's walk ending early.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from linuxgdb import GdbStack

_NUMBER = re.compile(r"0x[0-9a-f]+")
# The kinds of allowance, each the start of its sentence: a test caps how many stacks each.
STOPS_EARLY = "gdb stops at"
WALKS_ON = "gdb walks on past"
NO_TAILCALL = "gdb cannot make a tail-call frame"
KINDS = (STOPS_EARLY, WALKS_ON, NO_TAILCALL)


@dataclass(frozen=True, slots=True)
class Verdict:
    allowances: tuple[str, ...] = ()  # what gdb could not do, when not simply equal
    difference: str | None = None  # why the stacks differ

    @property
    def agrees(self) -> bool:
        return self.difference is None

    @property
    def equal(self) -> bool:
        return self.difference is None and not self.allowances

    @property
    def kinds(self) -> set[str]:
        """The kinds (KINDS) of its allowances."""
        return {kind for kind in KINDS for a in self.allowances if a.startswith(kind)}


def judge(
    gdb: GdbStack,
    ours: Sequence[int],
    ended: bool,
    function_start: Callable[[int], int | None],
) -> Verdict:
    """``ours``: qmpprof's kernel frames' pcs, leaf first; ``ended``: its walk reached the
    outermost frame (or went on into user frames). ``function_start``: the start of the
    function holding an address (the guest's kallsyms)."""
    theirs = [f.pc for f in gdb.frames]
    i = j = 0
    extra: list[int] = []  # indexes into ours of the frames gdb lacks
    while j < len(theirs) and i < len(ours):
        if ours[i] == theirs[j]:
            i, j = i + 1, j + 1
        elif ours[i] not in theirs[j:]:
            extra.append(i)
            i += 1
        else:
            return Verdict(difference=f"qmpprof lacks gdb's frame {j} {_frame(gdb, j)}")
    allowances: list[str] = []
    if j < len(theirs):
        if i < len(ours) or not ended:
            return Verdict(difference=f"qmpprof's walk ends before gdb's frame {_frame(gdb, j)}")
        allowances.append(f"{WALKS_ON} {gdb.frames[j - 1].symbol}" if j else "")
    elif not gdb.reached_entry and i < len(ours):
        stop = _NUMBER.sub("ADDR", gdb.stop)
        allowances.append(f"{STOPS_EARLY} {gdb.frames[-1].symbol if theirs else '?'}: {stop}")
    for run in _runs(extra):
        why = _why_no_tailcall(gdb, ours, run, function_start)
        if why is None:
            pcs = " ".join(f"{ours[k]:#x}" for k in run)
            return Verdict(difference=f"qmpprof has frames gdb lacks and does not explain: {pcs}")
        allowances.append(f"{NO_TAILCALL}: {why}")
    return Verdict(tuple(dict.fromkeys(a for a in allowances if a)))


def _frame(gdb: GdbStack, j: int) -> str:
    frame = gdb.frames[j]
    return f"{frame.symbol}@{frame.pc:#x} ({frame.kind})"


def _runs(indexes: list[int]) -> list[list[int]]:
    """Consecutive indexes grouped: the frames between one callee and its caller."""
    runs: list[list[int]] = []
    for k in indexes:
        if runs and runs[-1][-1] == k - 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def _why_no_tailcall(
    gdb: GdbStack,
    ours: Sequence[int],
    run: list[int],
    function_start: Callable[[int], int | None],
) -> str | None:
    """gdb's reason, in its debug output, for making no frame between the callee below
    ``run`` and the caller at the return address above it; None when it gives none."""
    if run[-1] + 1 >= len(ours) or run[0] == 0:
        return None
    ra = ours[run[-1] + 1]
    # The call at ra and the tail jumps of the path (a frame's pc is the address after its
    # jump: gdb's call site pc): gdb looks each up as a DWARF call site.
    sites = [f"{pc:#x}" for pc in (ra, *(ours[k] for k in run))]
    log = gdb.log
    if any(f"cannot find DW_TAG_call_site {site} " in line + " " for line in log for site in sites):
        return "no DWARF call site at a call or jump on the path (a call from inline asm)"
    if any(
        line.startswith(f"DW_AT_call_target is not specified at {site} ")
        for line in log
        for site in sites
    ):
        return "a DWARF call site on the path names no target (a function inlined elsewhere too)"
    if any(
        line.startswith("There are no unambiguously") and f"at {ra:#x} and" in line for line in log
    ):
        return "no unambiguous path of DWARF call sites (an assembly function's are empty)"
    starts = {function_start(ours[k] - 1) for k in run} | {_call_target(gdb, ra)}
    failed = "DW_TAG_call_site resolving failed to find function name"
    if any(line.startswith(failed) and int(line.split()[-1], 16) in starts for line in log):
        return "a function on the path has no DWARF (assembly)"
    return None


def _call_target(gdb: GdbStack, ra: int) -> int | None:
    """The target of the direct call (e8 rel32) before a return address, in running code."""
    for frame in gdb.frames:
        if frame.pc == ra and len(frame.before) == 8 and frame.before[3] == 0xE8:
            rel: int = struct.unpack("<i", frame.before[4:])[0]
            return (ra + rel) % 2**64
    return None
