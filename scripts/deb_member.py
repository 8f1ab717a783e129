"""Take one file out of a Debian package's data.tar.xz without decompressing the rest of it.

    python3 scripts/deb_member.py DEB OUT NAME [NAME ...] [--workers N]

Writes to OUT the regular file of the package's tar named NAME (any of them: a package may ship
the same file under another path with a symlink at the first one). Exit status 0 when written,
4 when the package has no such file, 3 when the data archive cannot be read block by block (not
xz, several streams, blocks too large to hold in memory): the caller then streams it through tar.

Why: a kernel's -dbg package is a 0.8-1.2 GB .deb holding a 5.5-8 GB tar; dpkg-deb | tar has to
decompress everything before a member to reach it (80 s of one core for unstable's vmlinux,
95 % of the way in). Debian's dpkg-deb compresses with threads, which cuts the xz stream into
independent blocks of 24 MiB listed in the stream's index with their offsets. So the member's
tar header is looked for block by block, the first block then from the last one backwards (the
vmlinux is in the first block of bookworm's and bullseye's packages, in the last 6 % of
unstable's), and only the blocks holding its data are decompressed, on every core; the blocks
the backward search decoded are kept for that. Each block is decoded as a one-block xz stream of
its own, so liblzma checks it (CRC64, sizes) as it checks any .xz file.
"""

from __future__ import annotations

import argparse
import lzma
import os
import struct
import sys
import zlib
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

NOT_FOUND = 4
UNSUPPORTED = 3
_XZ_MAGIC = b"\xfd7zXZ\x00"
_MAX_BLOCK = 256 << 20  # a decoded block is held in memory
_TAR_BLOCK = 512
_KEEP = 512 << 20  # decoded blocks kept while searching


class Unsupported(Exception):
    """The data archive is not a single multi-block xz stream this reader can seek in."""


@dataclass(frozen=True, slots=True)
class Block:
    offset: int  # of the block header, in the data member
    unpadded: int  # header + compressed data + check, as the index records it
    start: int  # of its first decoded byte, in the tar
    size: int  # decoded


def data_member(deb: BinaryIO) -> tuple[str, int, int]:
    """The name, offset and size of the .deb's data.tar.* (an ar archive's member)."""
    if deb.read(8) != b"!<arch>\n":
        raise Unsupported("not an ar archive")
    while header := deb.read(60):
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58])
        if name.startswith("data.tar"):
            return name, deb.tell(), size
        deb.seek(size + size % 2, os.SEEK_CUR)
    raise Unsupported("no data.tar member")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def xz_blocks(deb: BinaryIO, offset: int, size: int) -> tuple[bytes, list[Block]]:
    """The stream flags and the blocks of the one xz stream at ``offset`` (from its index)."""
    deb.seek(offset)
    head = deb.read(12)
    deb.seek(offset + size - 12)
    foot = deb.read(12)
    if head[:6] != _XZ_MAGIC or foot[10:] != b"YZ" or head[6:8] != foot[8:10]:
        raise Unsupported("not one xz stream without padding")
    index_size = (struct.unpack("<I", foot[4:8])[0] + 1) * 4
    index_at = offset + size - 12 - index_size
    deb.seek(index_at)
    index = deb.read(index_size)
    if index[0] != 0 or zlib.crc32(index[:-4]) != struct.unpack("<I", index[-4:])[0]:
        raise Unsupported("bad xz index")
    count, pos = _varint(index, 1)
    blocks = []
    at, start = 12, 0
    for _ in range(count):
        unpadded, pos = _varint(index, pos)
        decoded, pos = _varint(index, pos)
        blocks.append(Block(at, unpadded, start, decoded))
        at += unpadded + -unpadded % 4
        start += decoded
    if at != index_at - offset:
        raise Unsupported("the xz index does not cover the stream")
    if any(b.size > _MAX_BLOCK for b in blocks):
        raise Unsupported("xz blocks too large to decode one at a time")
    if any(b.start % _TAR_BLOCK for b in blocks):
        raise Unsupported("xz blocks not on tar record boundaries (a header could straddle two)")
    return head[6:8], blocks


class BlockReader:
    """Decodes single blocks of one xz stream, each wrapped as a stream of its own so that
    liblzma checks it (block check, index) as it checks any .xz file."""

    def __init__(self, path: Path, offset: int, flags: bytes, blocks: list[Block]) -> None:
        self.path, self.offset, self.flags, self.blocks = path, offset, flags, blocks

    def decode(self, i: int) -> bytes:
        block = self.blocks[i]
        with self.path.open("rb") as f:
            f.seek(self.offset + block.offset)
            raw = f.read(block.unpadded + -block.unpadded % 4)
        header = _XZ_MAGIC + self.flags + struct.pack("<I", zlib.crc32(self.flags))
        records = b"\0\x01" + _encode_varint(block.unpadded) + _encode_varint(block.size)
        records += b"\0" * (-len(records) % 4)
        index = records + struct.pack("<I", zlib.crc32(records))
        backward = struct.pack("<I", len(index) // 4 - 1) + self.flags
        footer = struct.pack("<I", zlib.crc32(backward)) + backward + b"YZ"
        data = lzma.decompress(header + raw + index + footer, format=lzma.FORMAT_XZ)
        if len(data) != block.size:
            raise lzma.LZMAError(f"block {i}: {len(data)} bytes, the index says {block.size}")
        return data


def ordered(
    decode: Callable[[int], bytes], order: list[int], workers: int
) -> Generator[tuple[int, bytes], None, None]:
    """Blocks decoded on ``workers`` threads (liblzma runs without the GIL), yielded in order."""
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[tuple[int, Future[bytes]]] = deque()
        todo = iter(order)
        for i in todo:
            pending.append((i, pool.submit(decode, i)))
            if len(pending) > workers:
                break
        try:
            while pending:
                i, future = pending.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(decode, nxt)))
                yield i, future.result()
        finally:  # the caller stopped early: decode no further
            for _, future in pending:
                future.cancel()


def _header_at(data: bytes, pos: int) -> tuple[str, int, bytes] | None:
    """(name, size, type flag) of a ustar header at ``pos``, if its checksum holds."""
    header = data[pos : pos + _TAR_BLOCK]
    if len(header) < _TAR_BLOCK or header[257:262] != b"ustar":
        return None
    try:
        checksum = int(header[148:156].split(b"\0")[0].strip() or b"-1", 8)
        size = int(header[124:136].split(b"\0")[0].strip() or b"0", 8)
    except ValueError:
        return None
    if checksum != sum(header[:148]) + 8 * 32 + sum(header[156:]):
        return None
    prefix = header[345:500].split(b"\0")[0]
    name = header[:100].split(b"\0")[0]
    full = (prefix + b"/" + name if prefix else name).decode(errors="replace")
    return full, size, header[156:157]


def find_header(data: bytes, start: int, names: list[str]) -> tuple[int, int] | None:
    """Where (offset in the tar) and how long the regular file named one of ``names`` is, if
    its header lies in this decoded block (which starts at ``start`` in the tar)."""
    for name in names:
        needle = name.encode() + b"\0"
        pos = data.find(needle)
        while pos != -1:
            if (start + pos) % _TAR_BLOCK == 0:
                found = _header_at(data, pos)
                if found is not None and found[0] == name and found[2] in (b"0", b"\0"):
                    return start + pos, found[1]
            pos = data.find(needle, pos + 1)
    return None


def search_order(count: int) -> list[int]:
    """The first block, then from the last one backwards: where the packages measured put
    their vmlinux (bookworm's and bullseye's in block 0, unstable's in the last 6 %)."""
    return [0, *range(count - 1, 0, -1)]


def extract(deb_path: Path, out: Path, names: list[str], workers: int) -> bool:
    """Write the member to ``out``; False when the package has none of ``names``."""
    with deb_path.open("rb") as deb:
        kind, offset, size = data_member(deb)
        if kind != "data.tar.xz":
            raise Unsupported(f"{kind}, not data.tar.xz")
        flags, blocks = xz_blocks(deb, offset, size)
    reader = BlockReader(deb_path, offset, flags, blocks)
    found = None
    # Searching backwards, the blocks decoded before the header's are its data: kept (up to
    # _KEEP bytes) so that they are not decoded twice.
    kept: dict[int, bytes] = {}
    with closing(ordered(reader.decode, search_order(len(blocks)), workers)) as decoded:
        for i, data in decoded:
            found = find_header(data, blocks[i].start, names)
            if found is not None or sum(map(len, kept.values())) + len(data) <= _KEEP:
                kept[i] = data
            if found is not None:
                break
    if found is None:
        return False
    begin = found[0] + _TAR_BLOCK
    end = begin + found[1]
    wanted = [i for i, b in enumerate(blocks) if b.start < end and b.start + b.size > begin]
    kept = {i: data for i, data in kept.items() if i in wanted}

    def block(i: int) -> bytes:
        return kept.pop(i) if i in kept else reader.decode(i)

    tmp = out.with_name(out.name + ".part")
    with tmp.open("wb") as f:
        for i, data in ordered(block, wanted, workers):
            start = blocks[i].start
            f.write(data[max(begin - start, 0) : end - start])
        written = f.tell()
    if written != found[1]:
        raise lzma.LZMAError(f"wrote {written} bytes of {found[1]}")
    tmp.replace(out)
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("deb", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="+", help="paths as in the tar, e.g. ./usr/lib/...")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    try:
        if not extract(args.deb, args.out, args.names, args.workers):
            print(f"deb_member: {args.deb} has no {' or '.join(args.names)}", file=sys.stderr)
            return NOT_FOUND
    except Unsupported as err:
        print(f"deb_member: {args.deb}: {err}", file=sys.stderr)
        return UNSUPPORTED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
