"""pprof input: a profile.proto (gunzipped) read back into a ``Profile``, so that ``qmpprof
report`` and ``qmpprof diff`` take what ``-o x.pb.gz`` and serve's /debug/pprof/profile write,
and a pprof from elsewhere as far as it carries.

What comes back from qmpprof's own (``pprof.py`` says what goes where): each sample's stack,
count and labels (``cpu``, ``mode``, the process from ``pid`` and ``process``, the thread from
``tid`` and ``thread``, ``truncated``); per location its frames (the inlined first, from its
lines) with function name, file and line; its mapping (range, file offset, path or name,
build-id); the period and the comments (the run's facts). Not carried by pprof, so not given
back: a frame's offset into its function (``--offsets`` names +0x0), the per-sample times
(samples are spread evenly over the duration), why a truncated walk stopped (``depth``), a
mapping's bias. A frame is kernel code at or above the run's kernel boundary (its fact,
``facts.BOUNDARY_KEY``: a teaching kernel linked at 0x80100000 keeps its own); without it, in
the upper half (above 2^63, or above 0xc0000000 in a profile whose addresses all fit 32 bits:
a pprof written before the fact was, or by serve). A pprof from elsewhere has
no such labels: its samples are kernel-less user stacks of no process, counted by its first
sample type (``samples``/``count`` when it has one).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from qmpprof.model import NO_CPU, Frame, Mapping, Mode, Process, Sample, Stack, StopReason
from qmpprof.naming import TRUNCATED, UNKNOWN, USER_GONE
from qmpprof.output.facts import BOUNDARY_KEY
from qmpprof.output.pprofproto import profile_pb2 as pb
from qmpprof.profile import Profile

_UPPER_HALF = 1 << 63
_I386_KERNEL = 0xC000_0000
_PID_LABEL = re.compile(r"(.*) \(pid (\d+)\)")
_SPACE_LABEL = re.compile(r"(?:(.*) \()?(\w+)=0x([0-9a-f]+)\)?")
# How pprof.py names a frame no symbol covers: [unknown] or its address, then the module's
# name where it has a file (a kernel module's is the mapping's own, bracketed).
_NO_SYMBOL = re.compile(r"(?:\[unknown\]|0x[0-9a-f]+)(?: \[(.*?)(?:\+0x[0-9a-f]+)?\])?(?:_\[i\])?")
# Counts summed: more is damage, not a profile (each sample is kept: 14 bytes, 56 MiB in all).
_MAX_SAMPLES = 1 << 22
_MAX_PERIOD = 60 * 10**9  # ns: an interval of a minute, as the .qmpprof reader takes


class PprofError(ValueError):
    """Bytes that are not a profile.proto message."""


# A sample's location ids, values and labels (key, str, num, num_unit).
_RawSample = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int, int, int], ...]]


@dataclass(slots=True)
class _Raw:
    """The parts of a profile.proto message, by id, with string indexes unresolved."""

    strings: list[str] = field(default_factory=list)
    sample_types: list[tuple[int, int]] = field(default_factory=list)
    samples: list[_RawSample] = field(default_factory=list)
    mappings: dict[int, tuple[int, int, int, int, int]] = field(default_factory=dict)
    locations: dict[int, tuple[int, int, list[tuple[int, int]]]] = field(default_factory=dict)
    functions: dict[int, tuple[int, int]] = field(default_factory=dict)  # name, file
    period_type: tuple[int, int] = (0, 0)
    period: int = 0
    duration: int = 0
    comments: list[int] = field(default_factory=list)

    def string(self, index: int) -> str:
        if not 0 <= index < len(self.strings):
            raise PprofError(f"string {index} of {len(self.strings)}")
        return self.strings[index]


def decode(data: bytes) -> Profile:
    """The ``Profile`` a profile.proto message holds. Raises PprofError."""
    raw = _parse(data)
    kinds = [(raw.string(t), raw.string(u)) for t, u in raw.sample_types]
    if not kinds:
        raise PprofError("no sample types: not a profile")
    column = kinds.index(("samples", "count")) if ("samples", "count") in kinds else 0
    nanoseconds = raw.string(raw.period_type[1]) == "nanoseconds"
    if nanoseconds and not 0 <= raw.period <= _MAX_PERIOD:
        raise PprofError(f"a period of {raw.period} ns")
    interval_ms = raw.period / 1e6 if nanoseconds and raw.period else 10.0
    facts = {}
    for index in raw.comments:
        key, colon, value = raw.string(index).partition(": ")
        if colon:
            facts[key] = value
    profile = Profile(interval_ms, facts)
    addresses = [address for _, address, _ in raw.locations.values()]
    boundary = _boundary(facts.get(BOUNDARY_KEY), addresses)
    mappings = _mappings(raw, boundary, _module_names(raw))
    # Identical sample messages share one parsed sample (``_parse``): each is read once.
    made: dict[int, tuple[int, Mode, Stack, Process | None, str | None]] = {}
    stacks = []
    for parsed in raw.samples:
        read = made.get(id(parsed))
        if read is None:
            read = made[id(parsed)] = _stack(raw, mappings, boundary, parsed[0], parsed[2])
        stacks.append(read)
    counts = [values[column] if column < len(values) else 0 for _, values, _ in raw.samples]
    if min(counts, default=0) < 0 or sum(counts) > _MAX_SAMPLES:
        raise PprofError(f"{sum(counts)} samples, or a negative count (this reads {_MAX_SAMPLES})")
    if not 0 <= raw.duration < 1 << 63:
        raise PprofError(f"a duration of {raw.duration} ns")
    step = raw.duration / 1e9 / max(1, sum(counts))
    at = 0
    sids: dict[int, int] = {}  # by the stack read (shared as above)
    for read, count in zip(stacks, counts, strict=True):
        if count:
            cpu, mode, stack, process, state = read
            sid = sids.get(id(read))
            if sid is None:
                sample = Sample(0.0, cpu, mode, mode is Mode.USER, 0, stack, process, state)
                sid = sids[id(read)] = profile.stack_id(sample)
            profile.add_at(at * step, cpu, sid, count, step)
            at += count
    return profile


def _parse(data: bytes) -> _Raw:
    try:
        message = pb.Profile.FromString(data)
    except DecodeError as err:
        raise PprofError(f"not a profile.proto message: {err}") from err
    raw = _Raw(
        strings=list(message.string_table),
        sample_types=[(t.type, t.unit) for t in message.sample_type],
        period_type=(message.period_type.type, message.period_type.unit),
        period=message.period,
        duration=message.duration_nanos,
        comments=list(message.comment),
    )
    # Identical samples (a stack on one vCPU, written once per run of it) share one tuple.
    samples: dict[_RawSample, _RawSample] = {}
    for sample in message.sample:
        labels = tuple((lb.key, lb.str, lb.num, lb.num_unit) for lb in sample.label)
        found = (tuple(sample.location_id), tuple(sample.value), labels)
        raw.samples.append(samples.setdefault(found, found))
    for m in message.mapping:
        raw.mappings[m.id] = (m.memory_start, m.memory_limit, m.file_offset, m.filename, m.build_id)
    for loc in message.location:
        lines = [(line.function_id, line.line) for line in loc.line]
        raw.locations[loc.id] = (loc.mapping_id, loc.address, lines)
    for f in message.function:
        raw.functions[f.id] = (f.name, f.filename)
    return raw


def _boundary(written: str | None, addresses: list[int]) -> int:
    """Where kernel code starts: as the run wrote it (``0x…``), else the upper half of the
    addresses' width."""
    try:
        value = int(written or "", 16)
    except ValueError:
        value = 0
    if 0 < value < 1 << 64:
        return value
    return _I386_KERNEL if addresses and max(addresses) >> 32 == 0 else _UPPER_HALF


def _module_names(raw: _Raw) -> dict[int, str]:
    """The name frames give each mapping's code, where a frame no symbol covers shows it (a
    mapping written with its file's path: ``[unknown] [libc.so.6]``)."""
    out: dict[int, str] = {}
    for mapping_id, _, lines in raw.locations.values():
        for function_id, _ in lines:
            name = raw.string(raw.functions.get(function_id, (0, 0))[0])
            found = _NO_SYMBOL.fullmatch(name)
            if mapping_id and found is not None and found[1] is not None:
                out.setdefault(mapping_id, found[1])
    return out


def _mappings(raw: _Raw, boundary: int, names: dict[int, str]) -> dict[int, Mapping]:
    """Mappings by id: bracketed names are names (a kernel module, code known by its range),
    other names are paths, and their code is named by the file's name."""
    out = {}
    for mapping_id, (start, limit, offset, file_index, build_id) in raw.mappings.items():
        written = raw.string(file_index) or f"[{start:#x}]"
        path = None if written.startswith("[") else written
        name = names.get(mapping_id, written if path is None else posixpath.basename(path))
        out[mapping_id] = Mapping(
            name, start, limit, start >= boundary, 0, path, raw.string(build_id) or None, offset
        )
    return out


def _stack(
    raw: _Raw,
    mappings: dict[int, Mapping],
    boundary: int,
    ids: tuple[int, ...],
    labels: tuple[tuple[int, int, int, int], ...],
) -> tuple[int, Mode, Stack, Process | None, str | None]:
    """A sample's vCPU, mode, stack, process and, off CPU, state (qmpprof's ``cpu_state``
    and ``state`` labels)."""
    text = {raw.string(key): raw.string(value) for key, value, _, _ in labels if value}
    numbers = {raw.string(key): num for key, value, num, _ in labels if not value}
    frames: list[Frame] = []
    truncated = text.get("truncated") == "true"
    gone = False
    for position, location_id in enumerate(ids):
        found = raw.locations.get(location_id)
        if found is None:
            raise PprofError(f"a sample names location {location_id}, which is not there")
        mapping_id, address, lines = found
        names = [(raw.string(raw.functions.get(f, (0, 0))[0]), f, line) for f, line in lines]
        marker = [n for n, _, _ in names] if not mapping_id and not address else []
        if marker in ([TRUNCATED], [USER_GONE]):
            # the root frame pprof.py adds to a truncated stack, or to one whose user space is gone
            truncated, gone = truncated or marker[0] == TRUNCATED, marker[0] == USER_GONE
            continue
        pc = address if position == 0 or not address else address + 1
        module = mappings.get(mapping_id)
        for index, (name, function_id, line) in enumerate(names or [(UNKNOWN, 0, 0)]):
            file = raw.string(raw.functions.get(function_id, (0, 0))[1]) or None
            symbol = None if _NO_SYMBOL.fullmatch(name) else name
            inlined = index < len(names) - 1
            frames.append(Frame(pc, pc >= boundary, symbol, 0, module, file, line or None, inlined))
    mode = Mode.USER if text.get("mode") == "user" else Mode.KERNEL
    if "mode" not in text:
        mode = Mode.KERNEL if frames and frames[0].kernel else Mode.USER
    stop = StopReason.DEPTH if truncated else StopReason.USER_GONE if gone else StopReason.END
    state = text.get("state") if text.get("cpu_state") == "offcpu" else None
    cpu = numbers.get("cpu", 0 if state is None else NO_CPU)
    if not 0 <= cpu <= NO_CPU:
        raise PprofError(f"vCPU {cpu}")
    return cpu, mode, Stack(tuple(frames), stop), _process(text, numbers), state


def _process(text: dict[str, str], numbers: dict[str, int]) -> Process | None:
    """The process its labels name (``Process.label`` read back), None for the kernel's."""
    label = text.get("process")
    if label is None or label == "kernel":
        return None
    tid, thread = numbers.get("tid"), text.get("thread")
    by_pid = _PID_LABEL.fullmatch(label)
    if by_pid is not None:
        program = None if by_pid[1] == UNKNOWN else by_pid[1]
        return Process(int(by_pid[2]), program, 0, tid, thread)
    by_space = _SPACE_LABEL.fullmatch(label)
    if by_space is not None:
        return Process(None, by_space[1], int(by_space[3], 16), tid, thread, by_space[2])
    return Process(numbers.get("pid"), label, 0, tid, thread)
