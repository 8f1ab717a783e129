"""Go's own pprof (Debian's golang-go, installed by scripts/setup) run on a profile file, and a
reader of its ``-top`` table; a tiny protobuf reader for looking at the bytes directly, and a
profile.proto message decoded with it (``decode``)."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TOP_ROW = re.compile(r"^\s*(\d+)\s+\S+%\s+\S+%\s+(\d+)\s+\S+%\s+(.+)$")


def go_pprof(tmp_path: Path, *args: str) -> str:
    """``go tool pprof ARGS`` with Go's caches in ``tmp_path``; its stdout."""
    go = shutil.which("go")
    assert go is not None, "go is missing: scripts/setup installs golang-go"
    home = tmp_path / "go-home"
    home.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "HOME": str(home),
        "GOCACHE": str(home / "cache"),
        "GOPATH": str(home / "path"),
        "GOFLAGS": "",
        "GOTOOLCHAIN": "local",
        "PPROF_TMPDIR": str(home),
    }
    run = subprocess.run(
        [go, "tool", "pprof", *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def top_flat(text: str) -> dict[str, int]:
    """Flat counts per function from ``-top -sample_index=samples`` output (flat > 0 only).
    The mark pprof puts after a function reached only (or also) through inlining is dropped:
    the callers compare with folded names, whose inlined mark they drop too."""
    flat: dict[str, int] = {}
    for line in text.splitlines():
        row = TOP_ROW.match(line)
        if row and int(row[1]):
            name = row[3].strip().removesuffix(" (inline)").removesuffix(" (partial-inline)")
            flat[name] = flat.get(name, 0) + int(row[1])
    return flat


def read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def fields(data: bytes) -> dict[int, list[int | bytes]]:
    """A message's fields: number -> values (ints for varints, bytes for length-delimited)."""
    out: dict[int, list[int | bytes]] = defaultdict(list)
    i = 0
    while i < len(data):
        key, i = read_varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = read_varint(data, i)
            out[number].append(value)
        elif wire_type == 2:
            size, i = read_varint(data, i)
            out[number].append(data[i : i + size])
            i += size
        else:
            raise ValueError(f"wire type {wire_type} at {i}")
    return out


def packed(data: int | bytes) -> list[int]:
    assert isinstance(data, bytes)
    values, i = [], 0
    while i < len(data):
        value, i = read_varint(data, i)
        values.append(value)
    return values


def one(msg: dict[int, list[int | bytes]], number: int) -> int:
    """A scalar field (0 when absent, as proto3 defaults)."""
    values = msg.get(number, [0])
    assert len(values) == 1 and isinstance(values[0], int)
    return values[0]


def sub(data: int | bytes) -> dict[int, list[int | bytes]]:
    assert isinstance(data, bytes)
    return fields(data)


@dataclass
class Decoded:
    strings: list[str]
    root: dict[int, list[int | bytes]]
    mappings: dict[int, dict[int, list[int | bytes]]]
    locations: dict[int, tuple[int, int, list[tuple[str, str, int]]]]  # mapping, address, lines
    samples: list[tuple[list[int], list[int], dict[str, str | int]]]

    def leaf_function(self, sample: int) -> str:
        return self.locations[self.samples[sample][0][0]][2][0][0]


def decode(data: bytes) -> Decoded:
    root = fields(gzip.decompress(data))
    strings = [s.decode() for s in root[6] if isinstance(s, bytes)]
    functions = {}
    for raw in root[5]:
        f = sub(raw)
        functions[one(f, 1)] = (strings[one(f, 2)], strings[one(f, 4)])
        assert one(f, 3) == one(f, 2)  # system_name
    mappings = {one(sub(raw), 1): sub(raw) for raw in root[3]}
    locations = {}
    for raw in root[4]:
        loc = sub(raw)
        lines = [(*functions[one(sub(x), 1)], one(sub(x), 2)) for x in loc.get(4, [])]
        locations[one(loc, 1)] = (one(loc, 2), one(loc, 3), lines)
    samples = []
    for raw in root[2]:
        s = sub(raw)
        labels: dict[str, str | int] = {}
        for raw_label in s.get(3, []):
            label = sub(raw_label)
            key = strings[one(label, 1)]
            labels[key] = strings[one(label, 2)] if one(label, 2) else one(label, 3)
        samples.append((packed(s[1][0]), packed(s[2][0]), labels))
    return Decoded(strings, root, mappings, locations, samples)
