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

from qmpprof.model import NO_CPU, Frame, Mapping
from qmpprof.naming import Naming, context_name, plain_name, stop_marker
from qmpprof.output.pprofproto import profile_pb2 as pb
from qmpprof.profile import Profile, StackRecord


def render(profile: Profile, naming: Naming) -> bytes:
    return gzip.compress(encode(profile, naming), mtime=0)


def encode(profile: Profile, naming: Naming) -> bytes:
    """The profile.proto message, before compression."""
    out = _Builder(naming)
    interval_ns = round(profile.interval_ms * 1e6)
    root = out.root
    for kind, unit in (("samples", "count"), ("cpu", "nanoseconds")):
        root.sample_type.append(out.value_type(kind, unit))
    per_cpu = Counter(zip(profile.stack_of, profile.cpus_of, strict=True))
    stack_locations: dict[int, list[int]] = {}
    for (sid, cpu), count in sorted(per_cpu.items()):
        record = profile.stacks[sid]
        locations = stack_locations.get(sid)
        if locations is None:
            locations = stack_locations[sid] = out.locations(record, profile.frames_of(record))
        root.sample.add(
            location_id=locations,
            value=(count, count * interval_ns),
            label=out.labels(record, cpu),
        )
    for mapping in out.mappings.values():
        root.mapping.append(mapping)
    if len(profile):
        root.duration_nanos = round(max(profile.times) * 1e9)
    root.period_type.CopyFrom(out.value_type("cpu", "nanoseconds"))
    root.period = interval_ns
    root.comment.extend(out.string(f"{fact}: {value}") for fact, value in profile.facts.items())
    root.string_table.extend(out.strings)  # last: every message above has added its strings
    return root.SerializeToString()


class _Builder:
    """The string table and the interned mappings, locations and functions (ids from 1), the
    locations and functions added to the profile message as they are first met."""

    def __init__(self, naming: Naming) -> None:
        # Symbol-less frames are named as folded names them; the rest of the naming is pprof's.
        self.naming = Naming(show_addresses=naming.show_addresses)
        self.root = pb.Profile()
        self.strings: list[str] = [""]
        self._string_ids: dict[str, int] = {"": 0}
        self.mappings: dict[Mapping, pb.Mapping] = {}
        self._location_ids: dict[tuple[int, tuple[Frame, ...]], int] = {}
        self._function_ids: dict[tuple[str, str], int] = {}
        self._markers: dict[str, int] = {}  # location ids of [truncated], [user space gone]

    def string(self, text: str) -> int:
        sid = self._string_ids.get(text)
        if sid is None:
            sid = self._string_ids[text] = len(self.strings)
            # Names come from guest bytes: a lone surrogate becomes "?", never an error.
            self.strings.append(text.encode("utf-8", "replace").decode())
        return sid

    def value_type(self, kind: str, unit: str) -> pb.ValueType:
        return pb.ValueType(type=self.string(kind), unit=self.string(unit))

    def labels(self, record: StackRecord, cpu: int) -> list[pb.Label]:
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

    def _label(self, key: str, text: str = "", num: int = 0, unit: str = "") -> pb.Label:
        if text:
            return pb.Label(key=self.string(key), str=self.string(text))
        # pprof drops a numeric label of 0 that has no unit: cpu 0 and pid 0 need theirs.
        return pb.Label(key=self.string(key), num=num, num_unit=self.string(unit))

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
        lid = self._location_ids[(address, group)] = len(self.root.location) + 1
        location = self.root.location.add(id=lid, address=address)
        module = group[-1].module
        if module is not None:
            mapping = self.mappings.get(module)
            if mapping is None:
                mapping = self.mappings[module] = self._mapping(module)
            if not mapping.has_line_numbers and any(f.line is not None for f in group):
                mapping.has_filenames = mapping.has_line_numbers = True
                mapping.has_inline_frames = True
            location.mapping_id = mapping.id
        for frame in group:
            location.line.add(function_id=self._function(frame), line=frame.line or 0)
        return lid

    def _mapping(self, module: Mapping) -> pb.Mapping:
        return pb.Mapping(
            id=len(self.mappings) + 1,
            memory_start=module.start,
            memory_limit=module.end,
            file_offset=module.file_offset,
            filename=self.string(module.path or module.name),
            build_id=self.string(module.build_id or ""),
            has_functions=True,
        )

    def _function(self, frame: Frame) -> int:
        # The bare symbol, no _[k]: pprof matches functions by name itself (naming.py's rule).
        name = frame.symbol if frame.symbol is not None else plain_name(frame, self.naming)
        return self._function_id(name, frame.file or "")

    def _function_id(self, name: str, file: str) -> int:
        fid = self._function_ids.get((name, file))
        if fid is None:
            fid = self._function_ids[(name, file)] = len(self.root.function) + 1
            name_id = self.string(name)
            self.root.function.add(
                id=fid, name=name_id, system_name=name_id, filename=self.string(file)
            )
        return fid

    def _marker_location(self, name: str) -> int:
        """The root location of every stack whose walk ended as ``name`` says."""
        lid = self._markers.get(name)
        if lid is None:
            lid = self._markers[name] = len(self.root.location) + 1
            function_id = self._function_id(name, "")
            self.root.location.add(id=lid, line=[pb.Line(function_id=function_id)])
        return lid
