"""Go's own pprof (Debian's golang-go, installed by scripts/setup) run on a profile file, and a
reader of its ``-top`` table; a tiny protobuf reader for looking at the bytes directly."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import defaultdict
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
    """Flat counts per function from ``-top -sample_index=samples`` output (flat > 0 only)."""
    flat: dict[str, int] = {}
    for line in text.splitlines():
        row = TOP_ROW.match(line)
        if row and int(row[1]):
            flat[row[3].strip()] = int(row[1])
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
