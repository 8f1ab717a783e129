"""The Emerald process-metadata page: one page at a fixed address in every user address space.

It holds eight little-endian u64: pid, image_base, image_size, program_headers_offset,
eh_frame_address, eh_frame_size, text_address, text_size. The program's name is not in it: a
profiler learns the name by hashing ``.text`` read from guest memory against ELF files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

METADATA_ADDR = 0xFFFF_FF7F_FFFF_E000
FIELDS = (
    "pid",
    "image_base",
    "image_size",
    "program_headers_offset",
    "eh_frame_address",
    "eh_frame_size",
    "text_address",
    "text_size",
)
SKIP = "_"

# Sizes beyond these are not a real user program's (a stray page of other data).
_MAX_IMAGE = 1 << 32


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    image_base: int
    image_size: int
    program_headers_offset: int
    eh_frame_address: int
    eh_frame_size: int
    text_address: int
    text_size: int

    @property
    def has_eh_frame(self) -> bool:
        return self.eh_frame_address != 0 and self.eh_frame_size != 0


def parse_layout(text: str) -> tuple[str, ...]:
    """A layout from a comma-separated list of field names (``_`` for a word to skip)."""
    names = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in names if n not in FIELDS and n != SKIP]
    missing = [n for n in FIELDS if n not in names]
    if unknown or missing:
        bad = ", ".join(unknown) or "missing " + ", ".join(missing)
        raise ValueError(f"metadata layout: {bad} (fields: {', '.join(FIELDS)}, _ to skip)")
    return names


def parse(data: bytes, layout: tuple[str, ...] = FIELDS) -> ProcessInfo | None:
    """The page's fields, or None when the bytes do not look like a metadata page.

    ``layout`` names the u64 words in page order. A page of zeros (kernel threads, or a kernel
    that does not follow the convention) and fields that contradict each other (text outside the
    image, absurd sizes) both give None.
    """
    if len(data) < 8 * len(layout):
        return None
    words = struct.unpack_from(f"<{len(layout)}Q", data)
    values = {name: word for name, word in zip(layout, words, strict=True) if name != SKIP}
    info = ProcessInfo(**values)
    if info.text_size == 0 or info.image_size == 0 or info.image_size > _MAX_IMAGE:
        return None
    image_end = info.image_base + info.image_size
    text_end = info.text_address + info.text_size
    if not (info.image_base <= info.text_address and text_end <= image_end):
        return None
    if info.eh_frame_size > info.image_size:
        return None
    return info
