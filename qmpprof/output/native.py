"""qmpprof's own profile file (``.qmpprof``): a run as data, to be rendered again later.

Gzipped JSON holding what the Profile holds: mappings, frames (addresses, symbols, offsets,
source lines, inlined flags), processes, distinct stacks and the per-sample timeline, the facts
and the interval. ``qmpprof report`` reads it back and writes any format in any naming;
``load`` also takes a gzipped pprof (``pprofread``), as far as pprof carries a run.
Addresses are hex strings: JSON numbers above 2**53 lose digits in many readers.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

from qmpprof.errors import ProfileError
from qmpprof.model import Frame, Mapping, Mode, Process, Sample, Stack, StopReason
from qmpprof.naming import Naming
from qmpprof.output import pprofread
from qmpprof.profile import Profile

KIND = "qmpprof-profile"
# 2: a stack may hold a fifth field, the state of a task off CPU. Version 1 files read as they
# are (their stacks hold four fields; a version-2 reader takes both).
VERSION = 2
READS = (1, 2)
MAX_PROFILE = 4 << 30  # a profile unpacked: larger is damage (~16 bytes a sample: 250 million)


def render(profile: Profile, naming: Naming) -> bytes:
    """The profile as a file; ``naming`` plays no part (names are made when it is rendered)."""
    mappings: dict[Mapping, int] = {}
    processes: dict[Process, int] = {}
    for frame in profile.frames:
        if frame.module is not None:
            mappings.setdefault(frame.module, len(mappings))
    for stack in profile.stacks:
        if stack.process is not None:
            processes.setdefault(stack.process, len(processes))
    doc = {
        "kind": KIND,
        "version": VERSION,
        "interval_ms": profile.interval_ms,
        "facts": profile.facts,
        "mappings": [
            [
                m.name,
                _hex(m.start),
                _hex(m.end),
                m.kernel,
                m.bias,
                m.path,
                m.build_id,
                m.file_offset,
            ]
            for m in mappings
        ],
        "processes": [
            [p.pid, p.program, _hex(p.space), p.tid, p.thread, p.space_name] for p in processes
        ],
        "frames": [
            [
                _hex(f.pc),
                f.kernel,
                f.symbol,
                f.offset,
                -1 if f.module is None else mappings[f.module],
                f.file,
                f.line,
                f.inlined,
            ]
            for f in profile.frames
        ],
        # An off-CPU stack's state follows its frames (absent on a CPU).
        "stacks": [
            [
                -1 if s.process is None else processes[s.process],
                s.mode.value,
                s.stop.value,
                list(s.frames),
                *([] if s.state is None else [s.state]),
            ]
            for s in profile.stacks
        ],
        "samples": {
            "time": [round(t, 6) for t in profile.times],
            "cpu": list(profile.cpus_of),
            "stack": list(profile.stack_of),
        },
    }
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    return gzip.compress(text.encode("utf-8"), mtime=0)


def load(path: Path) -> Profile:
    """Read a ``.qmpprof`` file (or a gzipped pprof) back; ProfileError (one line) for
    anything else."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ProfileError(str(path), err.strerror or str(err)) from err
    try:
        data = _gunzip(raw)
    except (OSError, EOFError, zlib.error, ValueError) as err:
        raise ProfileError(str(path), f"not gzipped JSON or pprof ({err})") from err
    if not data.lstrip().startswith(b"{"):
        try:
            return pprofread.decode(data)
        except (pprofread.PprofError, ValueError, KeyError, IndexError) as err:
            raise ProfileError(str(path), f"not a pprof profile either ({err})") from err
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as err:
        raise ProfileError(str(path), f"not gzipped JSON ({err})") from err
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ProfileError(str(path), "no qmpprof profile header")
    if doc.get("version") not in READS:
        reads = " and ".join(map(str, READS))
        raise ProfileError(str(path), f"version {doc.get('version')!r}, this qmpprof reads {reads}")
    try:
        return _profile(doc)
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise ProfileError(str(path), f"malformed ({type(err).__name__}: {err})") from err


def _profile(doc: dict[str, Any]) -> Profile:
    # Files written before mappings had a file offset hold seven fields.
    mappings = [
        Mapping(str(name), int(start, 16), int(end, 16), bool(kernel), int(bias),
                _str(path), _str(build_id), int(offset[0]) if offset else 0)
        for name, start, end, kernel, bias, path, build_id, *offset in doc["mappings"]
    ]  # fmt: skip
    # Files written before processes had threads hold three fields, before their space had a
    # name five: those came from x86 guests, whose page-table root is CR3.
    processes = [
        Process(None if pid is None else int(pid), _str(program), int(space, 16),
                None if t[0:1] in ([], [None]) else int(t[0]), _str(t[1]) if t[1:] else None,
                str(t[2]) if t[2:] else "cr3")
        for pid, program, space, *t in doc["processes"]
    ]  # fmt: skip
    frames = [
        Frame(int(pc, 16), bool(kernel), _str(symbol), int(offset),
              None if m < 0 else mappings[m], _str(file), None if line is None else int(line),
              bool(inlined))
        for pc, kernel, symbol, offset, m, file, line, inlined in doc["frames"]
    ]  # fmt: skip
    stacks = [
        (None if p < 0 else processes[p], Mode(mode), StopReason(stop),
         tuple(frames[i] for i in ids), str(state[0]) if state else None)
        for p, mode, stop, ids, *state in doc["stacks"]
    ]  # fmt: skip
    facts = doc["facts"]
    if not isinstance(facts, dict):
        raise TypeError("facts is not an object")
    profile = Profile(float(doc["interval_ms"]), {str(k): str(v) for k, v in facts.items()})
    samples = doc["samples"]
    for time, cpu, sid in zip(samples["time"], samples["cpu"], samples["stack"], strict=True):
        process, mode, stop, stack_frames, state = stacks[sid]
        user = mode is Mode.USER
        stack = Stack(stack_frames, stop)
        profile.add(Sample(float(time), int(cpu), mode, user, 0, stack, process, state))
    return profile


def _gunzip(raw: bytes) -> bytes:
    """The gzip member(s) in ``raw`` unpacked, at most MAX_PROFILE bytes."""
    unpacker = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = unpacker.decompress(raw, MAX_PROFILE + 1)
    if len(out) > MAX_PROFILE:
        raise ValueError(f"unpacks to more than {MAX_PROFILE >> 20} MiB")
    if not unpacker.eof:
        raise EOFError("the gzip stream ends early")
    return out


def _hex(value: int) -> str:
    return f"{value:#x}"


def _str(value: object) -> str | None:
    return None if value is None else str(value)
