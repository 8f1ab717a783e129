"""A Linux initramfs (the initrd a VM boots directly) unpacked into a folder, for its user
programs as ``--user-dir`` takes them: what the kernel itself unpacks at boot
(Documentation/driver-api/early-userspace/buffer-format.rst): cpio archives in the "newc"
format (magic ``070701``, or ``070702`` with checksums), one after another, zero bytes between
them, any of them compressed with a codec the kernel reads (bzimage's decompressors: gzip, xz,
lzma, bzip2, zstd, lz4) — Debian's initrd.img is an uncompressed cpio of CPU microcode, then a
zstd one of the rest.

Only regular files and folders are written: a symbolic link's target is a path in the guest,
which on this host would name the host's own file (the guest's mappings name the files
themselves). A name is kept inside the folder (no ``..``, a leading ``/`` dropped). The folder
is kept in qmpprof's cache under a key of the file's identity (path, size, modification time),
written under a temporary name and renamed when whole, so a second run takes it as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from qmpprof.errors import KernelImageError
from qmpprof.linux import bzimage
from qmpprof.linux.cache import cache_dir

_NEWC = (b"070701", b"070702")
_HEADER = 110  # the magic, then 13 fields of 8 hex digits
_TRAILER = "TRAILER!!!"
MAX_UNPACKED = 4 << 30  # more than an initramfs holds: damage


def unpacked(path: Path) -> Path:
    """The folder ``path``'s archives unpack to, in the cache (unpacked now when not there);
    KernelImageError (one line) for a file that is not an initramfs qmpprof reads."""
    info = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{info.st_size}\0{info.st_mtime_ns}".encode())
    folder = cache_dir() / "initramfs" / key.hexdigest()[:24]
    if folder.is_dir():
        return folder
    building = folder.with_name(f"{folder.name}.{os.getpid()}.part")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    try:
        written = 0
        for archive in _archives(path.read_bytes(), str(path)):
            written = _extract(archive, building, str(path), written)
        building.rename(folder)
    except OSError:
        if not folder.is_dir():  # not a run beside this one that finished first
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return folder


def _archives(data: bytes, where: str) -> Iterator[bytes]:
    """The uncompressed cpio data of each segment of ``data``, in order."""
    at = 0
    while at < len(data):
        if data[at] == 0:  # padding between archives
            at += 1
            continue
        if data[at : at + 6] in _NEWC:
            end = _archive_end(data, at, where)
            yield data[at:end]
            at = end
            continue
        # A compressed segment runs to the end of the file (what follows it, if anything, is
        # not told apart from it by the decompressors here).
        inner, _ = bzimage.unpacked(data[at:], where, "the initramfs", limit=MAX_UNPACKED)
        yield from _archives(inner, where)
        return


def _archive_end(data: bytes, at: int, where: str) -> int:
    """Where the cpio archive starting at ``at`` ends: after its trailer's entry."""
    while True:
        name, _mode, _size, _body, end = _entry(data, at, where)
        if name == _TRAILER:
            return end
        at = end


def _entry(data: bytes, at: int, where: str) -> tuple[str, int, int, int, int]:
    """The entry at ``at``: its name, mode, size, where its data starts, where it ends."""
    header = data[at : at + _HEADER]
    if len(header) < _HEADER or header[:6] not in _NEWC:
        raise KernelImageError(where, f"not a newc cpio archive at byte {at}")
    try:
        fields = [int(header[6 + 8 * i : 14 + 8 * i], 16) for i in range(13)]
    except ValueError:
        raise KernelImageError(where, f"a cpio header of no sense at byte {at}") from None
    mode, size, name_size = fields[1], fields[6], fields[11]
    name_end = at + _HEADER + name_size
    body = _aligned(name_end)
    end = _aligned(body + size)
    if name_size == 0 or end > len(data):
        raise KernelImageError(where, f"a cpio entry at byte {at} runs past the end")
    name = data[at + _HEADER : name_end - 1].decode("utf-8", "surrogateescape")
    return name, mode, size, body, end


def _aligned(offset: int) -> int:
    return (offset + 3) & ~3


def _extract(archive: bytes, folder: Path, where: str, written: int) -> int:
    """``archive``'s files and folders into ``folder``; the bytes written so far, counted
    against MAX_UNPACKED."""
    at = 0
    while at < len(archive):
        name, mode, size, body, end = _entry(archive, at, where)
        at = end
        if name == _TRAILER:
            break
        relative = _inside(name)
        if relative is None:
            continue
        target = folder / relative
        if stat.S_ISDIR(mode):
            target.mkdir(parents=True, exist_ok=True)
        elif stat.S_ISREG(mode):
            written += size
            if written > MAX_UNPACKED:
                raise KernelImageError(where, f"unpacks to more than {MAX_UNPACKED >> 30} GiB")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive[body : body + size])
    return written


def _inside(name: str) -> PurePosixPath | None:
    """``name`` as a path inside the folder, None for one that would leave it or is the root."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("/", ".")]
    if not parts or ".." in parts:
        return None
    return PurePosixPath(*parts)
