"""The kernel file as found in /boot -> the vmlinux ELF inside it.

An x86 bzImage is the real-mode setup (``setup_sects`` sectors of 512 bytes after the boot
sector), then the protected-mode part; the boot-protocol header (``HdrS`` at 0x202, version 2.08
or later) gives where in that part the compressed payload lies (``payload_offset`` and
``payload_length`` at 0x248 and 0x24c). On x86 the payload is the vmlinux ELF itself, with its
section headers and only its symbols stripped.

The codec is told by the payload's magic, as the kernel's own decompressor does: gzip, xz and
lzma (``.lzma``, "alone") and bzip2 from the standard library, zstd and lz4 from registry
packages. The kernel's lz4 payload uses lz4's legacy framing (a magic word, then blocks of at
most 8 MiB each behind a little-endian u32 length), which the lz4 frame API does not read, so
the blocks are unpacked one by one here. Most kernel payloads end with four bytes holding the
uncompressed size (``size_append``); they are ignored.

Unpacking stops at ``MAX_VMLINUX`` bytes: a few kilobytes of damaged or hostile payload can
claim gigabytes, and no kernel's vmlinux comes near the bound (Debian's are 40 to 80 MB).

The only module that imports ``zstandard`` and ``lz4``, when a payload needs them (a load from
the cache unpacks nothing).
"""

from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from collections.abc import Callable, Iterator

from qmpprof.errors import KernelImageError

ELF_MAGIC = b"\x7fELF"

_HDR_MAGIC = b"HdrS"
_SETUP_SECTS, _HDR_MAGIC_AT, _VERSION_AT, _PAYLOAD_AT = 0x1F1, 0x202, 0x206, 0x248
_MIN_VERSION = 0x208  # boot protocol 2.08 added payload_offset / payload_length
_LZ4_LEGACY_MAGIC = 0x184C2102
_LZ4_LEGACY_BLOCK = 8 << 20
MAX_VMLINUX = 256 << 20  # the largest vmlinux unpacked: bigger is damage, not a kernel
_STEP = 1 << 20  # output asked of a codec at a time
_ZSTD_INPUT = 1024  # zstd input fed at a time: its output per step is bounded by that

# Magic numbers in the order lib/decompress.c lists them; lzo is known so it can be named.
_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"),
    (b"\x1f\x9e", "gzip"),
    (b"BZh", "bzip2"),
    (b"\x5d\x00\x00", "lzma"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x89LZO", "lzo"),
    (struct.pack("<I", _LZ4_LEGACY_MAGIC), "lz4"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)


def vmlinux_bytes(data: bytes, path: str = "<kernel>") -> bytes:
    """The vmlinux ELF: ``data`` itself when it is one, else the bzImage's unpacked payload."""
    if data.startswith(ELF_MAGIC):
        return data
    elf, codec = unpacked(bzimage_payload(data, path), path, "bzImage payload")
    if not elf.startswith(ELF_MAGIC):
        raise KernelImageError(path, f"{codec} payload unpacks to something other than an ELF")
    return elf


def unpacked(payload: bytes, path: str, what: str, limit: int | None = None) -> tuple[bytes, str]:
    """``payload`` unpacked by the codec its magic names, and that codec's name; ``what`` names
    the payload in the errors (KernelImageError: unknown or unread codec, damage, more than
    ``limit`` bytes: a kernel's by default)."""
    codec = payload_codec(payload)
    if codec is None:
        raise KernelImageError(path, f"{what} of unknown kind (starts {payload[:6].hex()})")
    unpack = _UNPACKERS.get(codec)
    if unpack is None:
        raise KernelImageError(path, f"{what} is {codec}-compressed, which is not read")
    try:
        return _bounded(unpack(payload), MAX_VMLINUX if limit is None else limit), codec
    except _TooLarge:
        most, kernel = (MAX_VMLINUX, ": not a kernel") if limit is None else (limit, "")
        raise KernelImageError(
            path, f"{codec} payload unpacks to more than {most >> 20} MiB{kernel}"
        ) from None
    except Exception as err:  # each codec has its own error classes; all mean bad data here
        detail = " ".join(str(err).split()) or type(err).__name__
        raise KernelImageError(path, f"{codec} payload does not unpack ({detail})") from err


def is_bzimage(data: bytes) -> bool:
    return data[_HDR_MAGIC_AT : _HDR_MAGIC_AT + 4] == _HDR_MAGIC


def bzimage_payload(data: bytes, path: str = "<kernel>") -> bytes:
    """The compressed payload of a bzImage, located through its boot-protocol header."""
    if len(data) < _PAYLOAD_AT + 8 or not is_bzimage(data):
        raise KernelImageError(path, "neither an ELF file nor a bzImage (no HdrS boot header)")
    (version,) = struct.unpack_from("<H", data, _VERSION_AT)
    if version < _MIN_VERSION:
        raise KernelImageError(
            path, f"boot protocol {version >> 8}.{version & 0xFF:02d} has no payload fields"
        )
    setup_sects = data[_SETUP_SECTS] or 4  # 0 means 4, for the oldest boot loaders
    offset, length = struct.unpack_from("<II", data, _PAYLOAD_AT)
    start = (setup_sects + 1) * 512 + offset
    if length == 0 or start + length > len(data):
        raise KernelImageError(path, "bzImage payload runs past the end of the file")
    return data[start : start + length]


def payload_codec(payload: bytes) -> str | None:
    """The codec a compressed kernel payload starts with, by magic; None when unknown."""
    for magic, codec in _MAGICS:
        if payload.startswith(magic):
            return codec
    return None


class _TooLarge(Exception):
    """A payload that unpacks to more than its limit."""


def _bounded(pieces: Iterator[bytes], limit: int) -> bytes:
    """The pieces joined, stopped as soon as they pass ``limit`` bytes."""
    out = bytearray()
    for piece in pieces:
        out += piece
        if len(out) > limit:
            raise _TooLarge
    return bytes(out)


def _gzip(payload: bytes) -> Iterator[bytes]:
    unpacker = zlib.decompressobj(16 + zlib.MAX_WBITS)
    data = payload
    while not unpacker.eof:
        piece = unpacker.decompress(data, _STEP)
        data = unpacker.unconsumed_tail
        if not piece and not data:
            break  # nothing more comes of the input: it ended early
        yield piece
    _check_end(unpacker.eof)


def _lzma_with(fmt: int) -> Callable[[bytes], Iterator[bytes]]:
    def unpack(payload: bytes) -> Iterator[bytes]:
        return _stepwise(lzma.LZMADecompressor(fmt), payload)

    return unpack


def _bzip2(payload: bytes) -> Iterator[bytes]:
    return _stepwise(bz2.BZ2Decompressor(), payload)


def _stepwise(
    unpacker: lzma.LZMADecompressor | bz2.BZ2Decompressor, payload: bytes
) -> Iterator[bytes]:
    """lzma's and bz2's decompressors, asked for at most _STEP bytes at a time."""
    yield unpacker.decompress(payload, _STEP)
    while not unpacker.eof and not unpacker.needs_input:
        yield unpacker.decompress(b"", _STEP)
    _check_end(unpacker.eof)


def _zstd(payload: bytes) -> Iterator[bytes]:
    import zstandard

    # A streaming object: the kernel's frame, written through a pipe, records no content size.
    # It takes no output limit, so its input is fed in small slices.
    unpacker = zstandard.ZstdDecompressor().decompressobj()
    for pos in range(0, len(payload), _ZSTD_INPUT):
        if unpacker.eof:
            break
        yield unpacker.decompress(payload[pos : pos + _ZSTD_INPUT])
    _check_end(unpacker.eof)


def _lz4_legacy(payload: bytes) -> Iterator[bytes]:
    import lz4.block

    pos = 4
    while len(payload) - pos > 4:
        (size,) = struct.unpack_from("<I", payload, pos)
        pos += 4
        if size == _LZ4_LEGACY_MAGIC:  # another legacy stream, concatenated
            continue
        if pos + size > len(payload):
            raise ValueError("truncated block")
        block = payload[pos : pos + size]
        yield lz4.block.decompress(block, uncompressed_size=_LZ4_LEGACY_BLOCK)
        pos += size


def _check_end(eof: bool) -> None:
    if not eof:
        raise ValueError("the compressed stream ends early")


_UNPACKERS: dict[str, Callable[[bytes], Iterator[bytes]]] = {
    "gzip": _gzip,
    "xz": _lzma_with(lzma.FORMAT_XZ),
    "lzma": _lzma_with(lzma.FORMAT_ALONE),
    "bzip2": _bzip2,
    "zstd": _zstd,
    "lz4": _lz4_legacy,
}
