"""What loading a Linux kernel image computes, kept on disk for the next run: the vmlinux
unpacked from a bzImage (mapped, not read, by the next run), its kallsyms decoded, and the
``KernelIndex``: kallsyms' text symbols as a lookup table wants them, the ORC table's sorted
offsets and layout, where each BTF type starts. Keyed by the SHA-256 of the image file (a
distribution vmlinux has no build-id), in ``$QMPPROF_CACHE_DIR``, else
``$XDG_CACHE_HOME/qmpprof``, else ``~/.cache/qmpprof`` (made 0700). The key of a file seen
before is remembered while the file is unchanged (``keys/``), so that a cached load reads
neither the 10 MB bzImage nor hashes it.

The cache is an optimisation only: anything missing, unreadable, of the wrong size or from
another version is ignored (and rebuilt), and a cache that cannot be written is not an error.
Everything is stored as flat arrays (addresses as u64, one type letter each, names
NUL-separated) behind a JSON header, which load in milliseconds where a pickle of 160 000
strings takes a third of a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from qmpprof.linux.btf import BtfIndex
from qmpprof.linux.symbols import END, KernelSymbols

VERSION = 4
_VMLINUX = "vmlinux"
_SYMBOLS = "symbols.bin"
_INDEX = "index.bin"
_KEYS = "keys"  # a file's key while it is unchanged, by the SHA-256 of its absolute path
_HEX64 = re.compile("[0-9a-f]{64}")
Part: TypeAlias = "array[int] | bytes"
# What reading a damaged entry can raise (a header of the wrong shape: TypeError, AttributeError;
# nested without end: RecursionError): every one means "no usable entry".
_UNREADABLE = (
    OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError, IndexError,
    RecursionError,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class OrcIndex:
    """An ``OrcTable`` but its entries (which are the image's ``.orc_unwind`` as it is)."""

    base: int
    end: int
    layout: str  # OrcLayout's value
    offsets: Sequence[int]


@dataclass(frozen=True, slots=True)
class KernelIndex:
    """What a load derives from the vmlinux besides kallsyms, for the vmlinux of
    ``vmlinux_size`` bytes. ``functions``: kallsyms' text symbols (starts, ends, the index of
    each one's name in the kallsyms) as ``KernelSymbols.text_picks`` gives them, None when the
    image's ``.symtab`` names code."""

    vmlinux_size: int
    functions: tuple[list[int], list[int], Sequence[int]] | None
    orc: OrcIndex | None
    btf: BtfIndex | None


def cache_dir() -> Path:
    explicit = os.environ.get("QMPPROF_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qmpprof"


def entry(key: str) -> Path:
    return cache_dir() / f"linux-{key}"


def remembered_key(path: str | Path, stat: os.stat_result) -> str | None:
    """The key ``remember_key`` kept for the file at ``path``, None unless its ``stat`` is
    the one it had then."""
    try:
        record = json.loads((cache_dir() / _KEYS / _path_name(path)).read_bytes())
        key = record["key"]
        fresh = record["version"] == VERSION and record["stamp"] == _stamp(stat)
        return key if fresh and isinstance(key, str) and _HEX64.fullmatch(key) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember_key(path: str | Path, stat: os.stat_result, key: str) -> None:
    """Keep the key of the file at ``path`` as it was when ``stat`` was taken (before reading
    it: a change during the read makes the record stale, not wrong)."""
    record = {"version": VERSION, "stamp": _stamp(stat), "key": key}
    with contextlib.suppress(OSError):
        _write(_folder(_KEYS) / _path_name(path), json.dumps(record).encode())


def _stamp(stat: os.stat_result) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _path_name(path: str | Path) -> str:
    return hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()


def map_vmlinux(key: str, size: int) -> mmap.mmap | None:
    """The cached vmlinux mapped read-only, None unless it is there with ``size`` bytes."""
    try:
        with open(entry(key) / _VMLINUX, "rb") as f:
            if os.fstat(f.fileno()).st_size != size or not size:
                return None
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None


def load_symbols(key: str) -> KernelSymbols | None:
    try:
        data = (entry(key) / _SYMBOLS).read_bytes()
        head_len = int.from_bytes(data[:4], "little")
        head = json.loads(data[4 : 4 + head_len])
        if not isinstance(head, dict) or head.get("version") != VERSION:
            return None
        pos = 4 + head_len
        count = head["count"]
        addrs = array("Q")
        addrs.frombytes(data[pos : pos + 8 * count])
        pos += 8 * count
        types = data[pos : pos + count].decode("ascii")
        pos += count
        names_len = head["names"]
        names = data[pos : pos + names_len].decode("utf-8").split("\0")
        pos += names_len
        tail = data[pos:]
        if len(tail) == count - 1 and tail.count(0) == count - 1:
            modules: list[str | None] = [None] * count  # the image's own: every name empty
        else:
            modules = [m or None for m in tail.decode("utf-8").split("\0")]
        if not len(addrs) == len(types) == len(names) == len(modules) == count:
            return None
        return KernelSymbols(addrs.tolist(), list(types), names, modules)
    except _UNREADABLE:
        return None


def load_index(key: str) -> KernelIndex | None:
    try:
        found = _unpack((entry(key) / _INDEX).read_bytes())
        if found is None:
            return None
        meta, parts = found
        functions = None
        if meta["functions"]:
            starts, ends, picks = parts["starts"], parts["ends"], parts["picks"]
            assert isinstance(starts, array) and isinstance(ends, array)
            assert isinstance(picks, array)
            if not len(starts) == len(ends) == len(picks):
                return None
            bounds = ends.tolist()
            if bounds and not bounds[-1]:
                bounds[-1] = END  # only the last text symbol can have nothing above it
            if 0 in bounds:
                return None
            functions = (starts.tolist(), bounds, picks)
        orc = None
        if meta["orc"] is not None:
            base, end, layout = meta["orc"]
            offsets = parts["orc_offsets"]
            assert isinstance(offsets, array)
            orc = OrcIndex(int(base), int(end), str(layout), offsets)
        btf = None
        if meta["btf"]:
            starts, kinds = parts["btf_starts"], parts["btf_kinds"]
            assert isinstance(starts, array) and isinstance(kinds, bytes)
            btf = BtfIndex(starts, kinds, _btf_names(meta["btf_names"], parts))
        return KernelIndex(int(meta["vmlinux_size"]), functions, orc, btf)
    except _UNREADABLE:
        return None


def store(
    key: str,
    vmlinux: bytes | None,
    symbols: KernelSymbols | None,
    index: KernelIndex | None = None,
) -> None:
    """Keep what was computed (None: nothing new of that kind); silently nothing when the
    cache cannot be written."""
    with contextlib.suppress(OSError):
        folder = _folder(entry(key).name)
        if vmlinux is not None:
            _write(folder / _VMLINUX, vmlinux)
        if symbols is not None:
            _write(folder / _SYMBOLS, _symbols_blob(symbols))
        if index is not None:
            _write(folder / _INDEX, _index_blob(index))


def _symbols_blob(symbols: KernelSymbols) -> bytes:
    names = "\0".join(symbols.names).encode()
    modules = "\0".join(m or "" for m in symbols.modules).encode()
    head = json.dumps({"version": VERSION, "count": len(symbols), "names": len(names)})
    return b"".join(
        (
            len(head).to_bytes(4, "little"),
            head.encode(),
            array("Q", symbols.addrs).tobytes(),
            "".join(symbols.types).encode("ascii"),
            names,
            modules,
        )
    )


def _index_blob(index: KernelIndex) -> bytes:
    parts: dict[str, Part] = {}
    if index.functions is not None:
        starts, ends, picks = index.functions
        parts["starts"] = array("Q", starts)
        parts["ends"] = array("Q", [0 if e == END else e for e in ends])  # END is 2**64
        parts["picks"] = array("I", picks)
    orc = None
    if index.orc is not None:
        orc = [index.orc.base, index.orc.end, index.orc.layout]
        parts["orc_offsets"] = array("q", index.orc.offsets)
    name_kinds = []
    if index.btf is not None:
        parts["btf_starts"], parts["btf_kinds"] = index.btf.starts, index.btf.kinds
        for kind, names in index.btf.names.items():
            name_kinds.append(kind)
            parts[f"btf_names_{kind}"] = b"\0".join(names)
            parts[f"btf_ids_{kind}"] = array("I", names.values())
    meta: dict[str, object] = {
        "vmlinux_size": index.vmlinux_size,
        "functions": index.functions is not None,
        "orc": orc,
        "btf": index.btf is not None,
        "btf_names": name_kinds,
    }
    return _pack(meta, parts)


def _btf_names(kinds: list[int], parts: dict[str, Part]) -> dict[int, dict[bytes, int]]:
    """BTF's name index per kind: names NUL-separated, ids in the same order."""
    out = {}
    for kind in kinds:
        blob, ids = parts[f"btf_names_{kind}"], parts[f"btf_ids_{kind}"]
        assert isinstance(blob, bytes) and isinstance(ids, array)
        names = blob.split(b"\0") if ids else []
        if len(names) != len(ids):
            raise ValueError(f"BTF names of kind {kind}: {len(names)} names, {len(ids)} ids")
        out[int(kind)] = dict(zip(names, ids, strict=True))
    return out


def _pack(meta: dict[str, object], parts: dict[str, Part]) -> bytes:
    """A JSON header (the version, ``meta``, each part's name, typecode and length in bytes),
    then the parts' bytes one after the other."""
    layout = [
        [name, part.typecode if isinstance(part, array) else "", len(part) * _itemsize(part)]
        for name, part in parts.items()
    ]
    head = json.dumps({"version": VERSION, "meta": meta, "parts": layout}).encode()
    blobs = [p.tobytes() if isinstance(p, array) else p for p in parts.values()]
    return b"".join((len(head).to_bytes(4, "little"), head, *blobs))


def _unpack(data: bytes) -> tuple[dict[str, Any], dict[str, Part]] | None:
    """What ``_pack`` packed; None for another version or sizes that do not add up."""
    head_len = int.from_bytes(data[:4], "little")
    head = json.loads(data[4 : 4 + head_len])
    if not isinstance(head, dict) or head.get("version") != VERSION:
        return None
    meta = head.get("meta")
    if not isinstance(meta, dict):
        return None
    pos, parts, view = 4 + head_len, dict[str, Part](), memoryview(data)
    for name, typecode, size in head["parts"]:
        blob = view[pos : pos + size]
        pos += size
        if len(blob) != size:
            return None
        if typecode:
            values = array(typecode)
            values.frombytes(blob)  # ValueError when size is not a multiple of the item
            parts[name] = values
        else:
            parts[name] = bytes(blob)
    return (meta, parts) if pos == len(data) else None


def _itemsize(part: Part) -> int:
    return part.itemsize if isinstance(part, array) else 1


def _folder(name: str) -> Path:
    """A folder of the cache, made if need be (the cache itself private to its user)."""
    folder = cache_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        cache_dir().chmod(0o700)
    return folder


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a reader sees the old file or the new."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
