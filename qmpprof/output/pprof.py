"""pprof output: a gzipped profile.proto (github.com/google/pprof, proto/profile.proto), read by
``go tool pprof``, Pyroscope/Grafana, Parca and Cloud Profiler.

What goes where:

- sample types ``samples/count`` and ``cpu/nanoseconds`` (count x interval), the period one
  interval of cpu/nanoseconds, as Go's own CPU profiles have them;
- one Mapping per module (kernel image, user ELF, code known only by its range): runtime
  start and limit, the file offset of the start, the file's path (else the module's name) and
  build-id. Every location is named here, so each mapping says it has functions and pprof does
  not symbolize again; file names, lines and inline frames are claimed where DWARF gave them;
- one Location per distinct pc and frames at it: the runtime address (a caller's return address
  minus one, inside its call instruction, as Go writes caller pcs) and one Line per frame, the
  functions inlined at the pc first and the real function last, as pprof expects;
- Functions with the real symbol as name and system name and the source file: pprof makes its
  own +offset (``-addresses``) and file:line (``-lines``) views, and hides inlined frames with
  ``-noinlines``, so the naming option only names frames no symbol covers (``[unknown]``, or
  their address with ``--show-addresses`` or in a program without an ELF), as folded names them;
- labels per sample: ``cpu``, ``pid`` (when the guest gives one), ``process`` (the context,
  ``spin (pid 1)`` or ``kernel``), ``tid`` and ``thread`` (the thread's id and name, where the
  guest tells threads apart: Linux), ``mode`` (kernel/user), and ``truncated`` = ``true`` when the
  walk stopped early; such a stack also ends in a ``[truncated]`` root frame, as in folded
  output, so the graph does not show a partial stack as a complete one (one whose process's
  user space is gone ends in ``[user space gone]``);
- the run's facts as comments (``go tool pprof -comments``).
"""

from __future__ import annotations

import gzip
from collections import Counter
from dataclasses import dataclass

from qmpprof.model import NO_CPU, Frame, Mapping
from qmpprof.naming import Naming, context_name, plain_name, stop_marker
from qmpprof.output.protowire import Message
from qmpprof.profile import Profile, StackRecord

# profile.proto field numbers
P_SAMPLE_TYPE, P_SAMPLE, P_MAPPING, P_LOCATION, P_FUNCTION, P_STRINGS = 1, 2, 3, 4, 5, 6
P_DURATION, P_PERIOD_TYPE, P_PERIOD, P_COMMENT = 10, 11, 12, 13


def render(profile: Profile, naming: Naming) -> bytes:
    return gzip.compress(encode(profile, naming), mtime=0)


def encode(profile: Profile, naming: Naming) -> bytes:
    """The profile.proto message, before compression."""
    out = _Builder(naming)
    interval_ns = round(profile.interval_ms * 1e6)
    root = Message()
    for kind, unit in (("samples", "count"), ("cpu", "nanoseconds")):
        root.message(P_SAMPLE_TYPE, out.value_type(kind, unit))
    per_cpu = Counter(zip(profile.stack_of, profile.cpus_of, strict=True))
    stack_locations: dict[int, list[int]] = {}
    for (sid, cpu), count in sorted(per_cpu.items()):
        record = profile.stacks[sid]
        locations = stack_locations.get(sid)
        if locations is None:
            locations = stack_locations[sid] = out.locations(record, profile.frames_of(record))
        sample = Message().packed(1, locations).packed(2, (count, count * interval_ns))
        for label in out.labels(record, cpu):
            sample.message(3, label)
        root.message(P_SAMPLE, sample)
    for mapping in out.mappings.values():
        root.message(P_MAPPING, mapping.encode(out))
    for location in out.location_messages:
        root.message(P_LOCATION, location)
    for function in out.function_messages:
        root.message(P_FUNCTION, function)
    if len(profile):
        root.u64(P_DURATION, round(max(profile.times) * 1e9))
    root.message(P_PERIOD_TYPE, out.value_type("cpu", "nanoseconds"))
    root.u64(P_PERIOD, interval_ns)
    for fact, value in profile.facts.items():
        root.u64(P_COMMENT, out.string(f"{fact}: {value}"))
    for text in out.strings:  # last: every message above has added its strings
        root.string(P_STRINGS, text)
    return root.encode()


@dataclass(slots=True)
class _MappingInfo:
    id: int
    mapping: Mapping
    lines: bool = False  # some location of it has a source file and line

    def encode(self, out: _Builder) -> Message:
        m = self.mapping
        msg = Message().u64(1, self.id).u64(2, m.start).u64(3, m.end).u64(4, m.file_offset)
        msg.u64(5, out.string(m.path or m.name)).u64(6, out.string(m.build_id or ""))
        return msg.u64(7, 1).u64(8, self.lines).u64(9, self.lines).u64(10, self.lines)


class _Builder:
    """The string table and the interned mappings, locations and functions (ids from 1)."""

    def __init__(self, naming: Naming) -> None:
        # Symbol-less frames are named as folded names them; the rest of the naming is pprof's.
        self.naming = Naming(show_addresses=naming.show_addresses)
        self.strings: list[str] = [""]
        self._string_ids: dict[str, int] = {"": 0}
        self.mappings: dict[Mapping, _MappingInfo] = {}
        self._location_ids: dict[tuple[int, tuple[Frame, ...]], int] = {}
        self.location_messages: list[Message] = []
        self._function_ids: dict[tuple[str, str], int] = {}
        self.function_messages: list[Message] = []
        self._markers: dict[str, int] = {}  # location ids of [truncated], [user space gone]

    def string(self, text: str) -> int:
        sid = self._string_ids.get(text)
        if sid is None:
            sid = self._string_ids[text] = len(self.strings)
            self.strings.append(text)
        return sid

    def value_type(self, kind: str, unit: str) -> Message:
        return Message().u64(1, self.string(kind)).u64(2, self.string(unit))

    def labels(self, record: StackRecord, cpu: int) -> list[Message]:
        process = record.process
        out = [] if cpu == NO_CPU else [self._label("cpu", num=cpu, unit="vcpu")]
        out.append(self._label("cpu_state", "oncpu" if record.state is None else "offcpu"))
        if record.state is not None:
            out.append(self._label("state", record.state))
        if process is not None and process.pid is not None:
            out.append(self._label("pid", num=process.pid, unit="pid"))
        out.append(self._label("process", context_name(process)))
        if process is not None and process.tid is not None:
            out.append(self._label("tid", num=process.tid, unit="tid"))
        if process is not None and process.thread is not None:
            out.append(self._label("thread", process.thread))
        out.append(self._label("mode", record.mode.value))
        if record.truncated:
            out.append(self._label("truncated", "true"))
        return out

    def _label(self, key: str, text: str = "", num: int = 0, unit: str = "") -> Message:
        msg = Message().u64(1, self.string(key))
        if text:
            return msg.u64(2, self.string(text))
        # pprof drops a numeric label of 0 that has no unit: cpu 0 and pid 0 need theirs.
        return msg.i64(3, num).u64(4, self.string(unit))

    def locations(self, record: StackRecord, frames: list[Frame]) -> list[int]:
        """Location ids of a stack, leaf first: one per pc, its inlined frames as its lines."""
        ids: list[int] = []
        group: list[Frame] = []
        for frame in frames:
            group.append(frame)
            if not frame.inlined:
                ids.append(self._location(tuple(group), leaf=not ids))
                group = []
        if group:  # inlined frames with no real function after them
            ids.append(self._location(tuple(group), leaf=not ids))
        marker = stop_marker(record.stop)
        if marker is not None:
            ids.append(self._marker_location(marker))
        return ids

    def _location(self, group: tuple[Frame, ...], leaf: bool) -> int:
        pc = group[-1].pc
        address = pc if leaf or pc == 0 else pc - 1
        lid = self._location_ids.get((address, group))
        if lid is not None:
            return lid
        lid = self._location_ids[(address, group)] = len(self.location_messages) + 1
        msg = Message().u64(1, lid)
        module = group[-1].module
        if module is not None:
            info = self.mappings.get(module)
            if info is None:
                info = self.mappings[module] = _MappingInfo(len(self.mappings) + 1, module)
            info.lines = info.lines or any(f.line is not None for f in group)
            msg.u64(2, info.id)
        msg.u64(3, address)
        for frame in group:
            line = Message().u64(1, self._function(frame)).i64(2, frame.line or 0)
            msg.message(4, line)
        self.location_messages.append(msg)
        return lid

    def _function(self, frame: Frame) -> int:
        # The bare symbol, no _[k]: pprof matches functions by name itself (naming.py's rule).
        name = frame.symbol if frame.symbol is not None else plain_name(frame, self.naming)
        return self._function_id(name, frame.file or "")

    def _function_id(self, name: str, file: str) -> int:
        fid = self._function_ids.get((name, file))
        if fid is None:
            fid = self._function_ids[(name, file)] = len(self.function_messages) + 1
            msg = Message().u64(1, fid).u64(2, self.string(name)).u64(3, self.string(name))
            self.function_messages.append(msg.u64(4, self.string(file)))
        return fid

    def _marker_location(self, name: str) -> int:
        """The root location of every stack whose walk ended as ``name`` says."""
        lid = self._markers.get(name)
        if lid is None:
            lid = self._markers[name] = len(self.location_messages) + 1
            line = Message().u64(1, self._function_id(name, ""))
            self.location_messages.append(Message().u64(1, lid).message(4, line))
        return lid
