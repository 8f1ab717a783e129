"""What loading a Linux kernel image computes, kept on disk for the next run: the vmlinux
unpacked from a bzImage, and its kallsyms decoded. Keyed by the SHA-256 of the image file (a
distribution vmlinux has no build-id), in ``$QMPPROF_CACHE_DIR``, else
``$XDG_CACHE_HOME/qmpprof``, else ``~/.cache/qmpprof`` (made 0700).

The cache is an optimisation only: anything missing, unreadable or from another version is
ignored (and rebuilt), and a cache that cannot be written is not an error. Symbols are stored
as flat arrays (addresses as u64, one type letter each, names NUL-separated), which load in
milliseconds where a pickle of 160 000 strings takes a third of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from array import array
from pathlib import Path

from qmpprof.linux.symbols import KernelSymbols

VERSION = 1
_VMLINUX = "vmlinux"
_SYMBOLS = "symbols.bin"


def cache_dir() -> Path:
    explicit = os.environ.get("QMPPROF_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qmpprof"


def entry(key: str) -> Path:
    return cache_dir() / f"linux-{key}"


def load_vmlinux(key: str) -> bytes | None:
    try:
        return (entry(key) / _VMLINUX).read_bytes()
    except OSError:
        return None


def load_symbols(key: str) -> KernelSymbols | None:
    try:
        data = (entry(key) / _SYMBOLS).read_bytes()
        head_len = int.from_bytes(data[:4], "little")
        head = json.loads(data[4 : 4 + head_len])
        if head.get("version") != VERSION:
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
        modules = [m or None for m in data[pos:].decode("utf-8").split("\0")]
        if not len(addrs) == len(types) == len(names) == len(modules) == count:
            return None
        return KernelSymbols(addrs.tolist(), list(types), names, modules)
    except (OSError, ValueError, KeyError, UnicodeDecodeError):
        return None


def store(key: str, vmlinux: bytes | None, symbols: KernelSymbols) -> None:
    """Keep what was computed; silently nothing when the cache cannot be written."""
    with contextlib.suppress(OSError):
        folder = entry(key)
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            cache_dir().chmod(0o700)
        if vmlinux is not None:
            _write(folder / _VMLINUX, vmlinux)
        names = "\0".join(symbols.names).encode()
        modules = "\0".join(m or "" for m in symbols.modules).encode()
        head = json.dumps({"version": VERSION, "count": len(symbols), "names": len(names)})
        blob = b"".join(
            (
                len(head).to_bytes(4, "little"),
                head.encode(),
                array("Q", symbols.addrs).tobytes(),
                "".join(symbols.types).encode("ascii"),
                names,
                modules,
            )
        )
        _write(folder / _SYMBOLS, blob)


def _write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
