"""What the command line prints: one-shot stacks (text or JSON), top stacks, the live progress
line and the end summary. Pure functions from data to text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from qmpprof.cli.options import Options
from qmpprof.model import Frame, Process, Sample, TaskView
from qmpprof.naming import Detail, Naming, frame_name, names_module
from qmpprof.output import viewer_hint
from qmpprof.profile import Profile
from qmpprof.stats import SamplerStats

_LISTING = Naming(Detail.OFFSET)


def frame_text(frame: Frame, show_addresses: bool) -> str:
    """A frame of a one-shot listing: ``function+0x1f (module)``, named as in every output
    (``_[k]`` on kernel code), the module added where the name does not carry it already; the
    address first if asked."""
    name = frame_name(frame, _LISTING)
    if frame.module is not None and not names_module(frame):
        name += f" ({Path(frame.module.name).name})"
    return f"{frame.pc:#018x} {name}" if show_addresses else name


def one_shot_text(samples: Sequence[Sample], show_addresses: bool) -> str:
    lines = []
    for s in samples:
        who = "" if s.process is None else f"  {s.process.label}{_thread(s.process)}"
        state = "user" if s.user else "kernel"
        lines.append(
            f"vCPU {s.cpu}: {s.mode.value} (CPU in {state} mode, page tables {s.space:#x}){who}"
        )
        for i, frame in enumerate(s.stack.frames):
            lines.append(f"  #{i:<2} {frame_text(frame, show_addresses)}")
        if s.stack.truncated:
            lines.append(f"  [truncated: {s.stack.stop.value}]")
    return "\n".join(lines) + "\n"


def _thread(process: Process) -> str:
    if process.tid is None or (process.tid == process.pid and process.thread == process.program):
        return ""
    return f" thread {process.thread or '?'} (tid {process.tid})"


def tasks_text(tasks: Sequence[TaskView], show_addresses: bool) -> str:
    """Every task: who, its state, where it runs or its stacks (``--off-cpu``)."""
    on_cpu = sum(t.cpu is not None for t in tasks)
    lines = [f"Tasks: {len(tasks)} ({on_cpu} on a CPU, {len(tasks) - on_cpu} off)"]
    for t in tasks:
        where = "" if t.cpu is None else f", on vCPU {t.cpu}"
        lines.append(f"{_who(t.process)}: {t.state} ({t.state_name}){where}")
        if t.stack is None:
            if t.cpu is None:
                lines.append("  [no stack]")
            continue
        for i, frame in enumerate(t.stack.frames):
            lines.append(f"  #{i:<2} {frame_text(frame, show_addresses)}")
        if t.stack.truncated:
            lines.append(f"  [truncated: {t.stack.stop.value}]")
    return "\n".join(lines) + "\n"


def _who(process: Process | None) -> str:
    if process is None:
        return "?"
    return f"{process.label}{_thread(process) or f' tid {process.tid}'}"


def one_shot_json(samples: Sequence[Sample], tasks: Sequence[TaskView] | None = None) -> str:
    """Addresses and page-table roots as hex strings: JSON numbers above 2**53 lose digits in
    JavaScript and in many other readers, and every kernel address is above it. With
    ``tasks`` (``--off-cpu``): an object, the samples as ``vcpus``, the tasks as ``tasks``."""
    doc = [
        {
            "cpu": s.cpu,
            "mode": s.mode.value,
            "user": s.user,
            "space": f"{s.space:#x}",
            "process": _process_json(s.process),
            "stop": s.stack.stop.value,
            "frames": _frames_json(s.stack.frames),
        }
        for s in samples
    ]
    if tasks is None:
        return json.dumps(doc, indent=2) + "\n"
    listed = [
        {
            "process": _process_json(t.process),
            "state": t.state,
            "state_name": t.state_name,
            "cpu": t.cpu,
            "stop": None if t.stack is None else t.stack.stop.value,
            "frames": None if t.stack is None else _frames_json(t.stack.frames),
        }
        for t in tasks
    ]
    return json.dumps({"vcpus": doc, "tasks": listed}, indent=2) + "\n"


def _process_json(process: Process | None) -> dict[str, object] | None:
    if process is None:
        return None
    return {
        "pid": process.pid,
        "program": process.program,
        "label": process.label,
        "tid": process.tid,
        "thread": process.thread,
    }


def _frames_json(frames: Sequence[Frame]) -> list[dict[str, object]]:
    """Each frame as data: ``kernel`` (kernel code), ``inlined`` (a function inlined at the pc
    of the real frame after it) and ``tail_call`` (a function that had left the stack by a tail
    jump, put back from the code: its address is after its jump)."""
    return [
        {
            "address": f"{f.pc:#x}",
            "symbol": f.symbol,
            "offset": f.offset,
            "module": f.module_name,
            "kernel": f.kernel,
            "inlined": f.inlined,
            "tail_call": f.tail_call,
        }
        for f in frames
    ]


def top_stacks(profile: Profile, naming: Naming, n: int = 10) -> str:
    counts = profile.named_counts(naming)
    total = sum(counts.values())
    if not total:
        return "No samples.\n"
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    lines = [f"Top {len(ordered)} of {len(counts)} stacks ({total} samples), root first:"]
    lines += [f"{c:7d} {c / total:6.1%}  {';'.join(names)}" for names, c in ordered]
    return "\n".join(lines) + "\n"


def start_line(opts: Options) -> str:
    """Said once sampling starts (signals are handled from then on)."""
    sampling = opts.spec.sampling
    return (
        f"qmpprof: sampling {opts.spec.reach.where} every {sampling.interval * 1e3:g} ms for"
        f" {sampling.duration:g} s of guest run time (Ctrl-C stops early)"
    )


def progress_line(stats: SamplerStats, samples: int, duration: float) -> str:
    median = stats.pause_ms()[0]
    left = max(0.0, duration - stats.run_time)
    return (
        f"\rqmpprof: {samples} samples  {stats.wall_rate_hz():.0f} Hz"
        f"  pause {median:.2f} ms  errors {stats.error_count}  {left:.1f} s left  "
    )


def written_line(path: Path, fmt: str) -> str:
    if path == Path("-"):
        return f"Wrote the profile on standard output ({fmt})"
    return f"Wrote {path} ({fmt}); view it: {viewer_hint(fmt, path)}"
