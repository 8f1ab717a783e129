"""Compressed kernel images made by their documented layouts, for the readers' tests: the
payload codecs a bzImage or an arm64 Image.gz may carry (with the plain size the kernel's build
appends), and EFI zboot images of an arm64 Image."""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
from collections.abc import Callable

import lz4.block
import zstandard


def size_append(data: bytes) -> bytes:
    """The four bytes the kernel's build appends to a compressed payload: the plain size."""
    return struct.pack("<I", len(data) & 0xFFFFFFFF)


def lz4_legacy(data: bytes) -> bytes:
    """lz4 -l: magic 0x184C2102, then blocks of at most 8 MiB, each behind its u32 length."""
    out = [struct.pack("<I", 0x184C2102)]
    for at in range(0, len(data), 8 << 20):
        block = lz4.block.compress(data[at : at + (8 << 20)], store_size=False)
        out += [struct.pack("<I", len(block)), block]
    return b"".join(out)


def lzma_alone(data: bytes) -> bytes:
    return lzma.compress(data, format=lzma.FORMAT_ALONE)


def xz_kernel(data: bytes) -> bytes:
    # As scripts/xz_wrap.sh does: CRC32 check, x86 BCJ filter, then LZMA2.
    filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 6}]
    return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, filters=filters)


COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "xz": xz_kernel,
    "lzma": lzma_alone,
    "bzip2": bz2.compress,
    "zstd": lambda data: zstandard.ZstdCompressor(level=19, write_content_size=False).compress(
        data
    ),
    "lz4": lz4_legacy,
}


# Makefile.zboot's codec names for COMPRESSORS' codecs (bzip2 has none: zboot does not use it).
ZBOOT_NAMES = {"gzip": "gzip", "xz": "xzkern", "lzma": "lzma", "zstd": "zstd22", "lz4": "lz4"}
ZBOOT_PAYLOAD_AT = 0x1000


def zboot(plain: bytes, codec: str = "gzip", name: str | None = None) -> bytes:
    """An EFI zboot image of the Image ``plain`` as zboot-header.S lays it out: "MZ", "zimg",
    the payload's offset and size, the codec's name, the Linux PE magic and the PE header's
    offset; then at ZBOOT_PAYLOAD_AT the Image padded to its image_size, compressed, with its
    unpacked size appended (left out of the header's size but for gzip, whose trailer it is)."""
    image_size = struct.unpack_from("<Q", plain, 16)[0]
    padded = plain + bytes(max(0, image_size - len(plain)))
    payload = PACK[codec](padded)
    header = bytearray(ZBOOT_PAYLOAD_AT)
    struct.pack_into("<4s4sII", header, 0, b"MZ\0\0", b"zimg", ZBOOT_PAYLOAD_AT, len(payload))
    header[24 : 24 + 8] = (name or ZBOOT_NAMES[codec]).encode().ljust(8, b"\0")
    struct.pack_into("<II", header, 0x38, 0x818223CD, 0x40)  # LINUX_PE_MAGIC, the PE header
    header[0x40:0x44] = b"PE\0\0"
    trailer = b"" if codec == "gzip" else size_append(padded)
    return bytes(header) + payload + trailer + bytes(0x200)  # the stub's code after it


# Fast enough for a 30-40 MB Image (COMPRESSORS' zstd is level 19).
PACK: dict[str, Callable[[bytes], bytes]] = COMPRESSORS | {
    "gzip": lambda data: gzip.compress(data, compresslevel=1),
    "zstd": zstandard.ZstdCompressor(level=3, write_content_size=False).compress,
}
