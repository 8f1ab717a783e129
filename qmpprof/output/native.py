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
import re
import zlib
from pathlib import Path
from typing import Any

import qmpprof.output.pprofread as pprofread
from qmpprof.errors import ProfileError
from qmpprof.model import NO_CPU, Frame, Mapping, Mode, Process, Sample, Stack, StopReason
from qmpprof.naming import Naming
from qmpprof.profile import Profile

KIND = "qmpprof-profile"
# 2: a stack may hold a fifth field, the state of a task off CPU. Version 1 files read as they
# are (their stacks hold four fields; a version-2 reader takes both).
VERSION = 2
READS = (1, 2)
MAX_PROFILE = 4 << 30  # a profile unpacked: larger is damage (~16 bytes a sample: 250 million)
MAX_UNPACKED = 2 * MAX_PROFILE  # white space in a JSON text is unpacked but not kept
MAX_STRING = 1 << 16  # characters of a name, path or fact
_MAX_BACKSLASHES = 2 * MAX_STRING  # in a row: a string of MAX_STRING of them, each escaped
_PIECE = 1 << 22  # bytes unpacked at a time
_SPACE = b" \t\r\n"
_SPACES = (b" ", b"\n", b"\t", b"\r")
# A JSON string, or white space outside one: replaced by the string (group 1) or nothing. A
# string runs to the end of the text when it is not closed there (held over to the next piece,
# or damage the JSON reader refuses), so that no quote is tried twice.
_STRING_OR_SPACE = re.compile(rb'("[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z))|[ \t\r\n]+', re.DOTALL)
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_U64 = 1 << 64
_I64 = 1 << 63
_MAX_INTERVAL_MS = 60_000.0  # a minute: an interval times 2**27 samples stays an int64 of ns
_MAX_TIME = float(1 << 34)  # seconds into a run (544 years): its nanoseconds fit 64 bits
_SURROGATE = re.compile("[\ud800-\udfff]")


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
    # A lone surrogate (a name from guest bytes) can only be in a string: written as JSON's
    # escape of it, which the reader replaces.
    return gzip.compress(text.encode("utf-8", "backslashreplace"), mtime=0)


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
    if not data.startswith(b"{"):
        try:
            return pprofread.decode(data)
        except (pprofread.PprofError, ValueError, KeyError, IndexError) as err:
            raise ProfileError(str(path), f"not a pprof profile either ({err})") from err
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ProfileError(str(path), "JSON nested deeper than a profile is") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise ProfileError(str(path), f"not gzipped JSON ({err})") from err
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ProfileError(str(path), "no qmpprof profile header")
    if doc.get("version") not in READS:
        reads = " and ".join(map(str, READS))
        raise ProfileError(str(path), f"version {doc.get('version')!r}, this qmpprof reads {reads}")
    try:
        return _profile(doc)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as err:
        raise ProfileError(str(path), f"malformed ({type(err).__name__}: {err})") from err


def _profile(doc: dict[str, Any]) -> Profile:
    # Files written before mappings had a file offset hold seven fields.
    mappings = [
        Mapping(_text(name), _u64(start), _u64(end), bool(kernel), _number(bias, -_U64, _U64),
                _str(path), _str(build_id), _number(offset[0], 0, _U64) if offset else 0)
        for name, start, end, kernel, bias, path, build_id, *offset in _list(doc["mappings"])
    ]  # fmt: skip
    # Files written before processes had threads hold three fields, before their space had a
    # name five: those came from x86 guests, whose page-table root is CR3.
    processes = [
        Process(None if pid is None else _number(pid, 0, _I64), _str(program), _u64(space),
                None if t[0:1] in ([], [None]) else _number(t[0], 0, _I64),
                _str(t[1]) if t[1:] else None, _text(t[2]) if t[2:] else "cr3")
        for pid, program, space, *t in _list(doc["processes"])
    ]  # fmt: skip
    frames = [
        Frame(_u64(pc), bool(kernel), _str(symbol), _number(offset, -_U64, _U64),
              None if _index(m, mappings, -1) < 0 else mappings[m], _str(file),
              None if line is None else _number(line, 0, _I64), bool(inlined))
        for pc, kernel, symbol, offset, m, file, line, inlined in _list(doc["frames"])
    ]  # fmt: skip
    stacks = [
        (None if _index(p, processes, -1) < 0 else processes[p], Mode(mode), StopReason(stop),
         tuple(frames[_index(i, frames)] for i in _list(ids)), _text(state[0]) if state else None)
        for p, mode, stop, ids, *state in _list(doc["stacks"])
    ]  # fmt: skip
    facts = doc["facts"]
    if not isinstance(facts, dict):
        raise TypeError("facts is not an object")
    interval = _seconds(doc["interval_ms"], _MAX_INTERVAL_MS)
    if not interval > 0:
        raise ValueError(f"an interval of {interval} ms")
    profile = Profile(interval, {_text(k): _text(v) for k, v in facts.items()})
    samples = doc["samples"]
    for time, cpu, sid in zip(samples["time"], samples["cpu"], samples["stack"], strict=True):
        process, mode, stop, stack_frames, state = stacks[_index(sid, stacks)]
        user = mode is Mode.USER
        stack = Stack(stack_frames, stop)
        at, on = _seconds(time, _MAX_TIME), _number(cpu, 0, NO_CPU + 1)
        profile.add(Sample(at, on, mode, user, 0, stack, process, state))
    return profile


def _list(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"a list expected, not {type(value).__name__}")
    return value


def _number(value: object, low: int, high: int) -> int:
    """An integer in ``low`` .. ``high`` - 1 (JSON's, or a whole float)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise TypeError(f"{value!r} is not an integer")
    if not low <= value < high:
        raise ValueError(f"{int(value)} is out of range")
    return int(value)


def _u64(value: object) -> int:
    """An address: a hex string of 64 bits at most."""
    if not isinstance(value, str) or len(value) > 18 or not 0 <= int(value, 16) < _U64:
        raise ValueError(f"{value!r} is not an address")
    return int(value, 16)


def _index(value: object, items: list[Any], low: int = 0) -> int:
    """An index into ``items`` (``low`` to ``len(items) - 1``: -1 says "none")."""
    return _number(value, low, len(items))


def _seconds(value: object, high: float) -> float:
    """A number in 0 .. ``high`` (finite: pprof's durations and values are int64)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
        raise ValueError(f"{value!r} is not a time in 0 .. {high:g}")
    return float(value)


def _text(value: object) -> str:
    """A string as a name: any lone surrogate (JSON can escape one) replaced, at most
    MAX_STRING characters."""
    if not isinstance(value, str):
        value = str(value)
    if len(value) > MAX_STRING:
        raise ValueError(f"a string of {len(value)} characters")
    return _SURROGATE.sub("\ufffd", value)


def _gunzip(raw: bytes) -> bytes:
    """The gzip member in ``raw`` unpacked, in pieces: a JSON text without the white space
    between its tokens (what is kept is what the profile holds), a pprof as it is; at most
    MAX_PROFILE bytes kept, MAX_UNPACKED unpacked."""
    unpacker = zlib.decompressobj(16 + zlib.MAX_WBITS)
    kept: list[bytes] = []
    squeeze: _Squeeze | None = None
    size = unpacked = skipped = 0
    pending = raw
    while not unpacker.eof:
        piece = unpacker.decompress(pending, _PIECE)
        pending = unpacker.unconsumed_tail
        if not piece and not pending:
            raise EOFError("the gzip stream ends early")
        unpacked += len(piece)
        if not kept and squeeze is None:
            rest = piece.lstrip(_SPACE)
            if rest and rest[:1] != b"{":  # a pprof, whose first bytes may be these
                if skipped:
                    raise ValueError(f"{skipped} bytes of white space, then no JSON")
                rest = piece
            elif rest:
                squeeze = _Squeeze()
            skipped += len(piece) - len(rest)
            piece = rest
        if squeeze is not None:
            piece = squeeze.feed(piece)
        if piece:
            kept.append(piece)
            size += len(piece)
        if size > MAX_PROFILE or unpacked > MAX_UNPACKED:
            raise ValueError(f"unpacks to more than {MAX_PROFILE >> 20} MiB")
    if squeeze is not None:
        kept.append(squeeze.held)  # backslashes at the very end: the JSON reader refuses them
    return b"".join(kept)


class _Squeeze:
    """A JSON text fed in pieces, given back without the white space outside its strings.
    Between pieces it keeps whether a string is open, and holds back a run of backslashes
    the end of a piece cuts (at most _MAX_BACKSLASHES: longer is damage)."""

    def __init__(self) -> None:
        self.held = b""
        self._open = False

    def feed(self, piece: bytes) -> bytes:
        text, self.held = self.held + piece, b""
        if text.endswith(b"\\"):  # it may escape the next piece's first byte
            kept = len(text.rstrip(b"\\"))
            text, self.held = text[:kept], text[kept:]
            if len(self.held) > _MAX_BACKSLASHES:
                raise ValueError(f"a run of {len(self.held)} backslashes")
        was_open = self._open
        # Each quote left once the escapes are gone opens or closes a string.
        self._open ^= _ESCAPE.sub(b"", text).count(b'"') % 2 == 1
        if not any(space in text for space in _SPACES):
            return text  # nothing to take out (qmpprof writes none outside strings)
        if b'"' not in text:  # all in one string, or all between two
            return text if was_open else text.translate(None, _SPACE)
        if not was_open:
            return _STRING_OR_SPACE.sub(rb"\1", text)
        # The string the last piece left open goes on: the regex is told by its quote.
        return _STRING_OR_SPACE.sub(rb"\1", b'"' + text)[1:]


def _str(value: object) -> str | None:
    return None if value is None else _text(value)


def _hex(value: int) -> str:
    return f"{value:#x}"
