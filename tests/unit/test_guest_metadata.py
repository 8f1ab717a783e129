"""The Emerald metadata page parser: layouts, plausibility checks."""

from __future__ import annotations

import struct

import pytest

from qmpprof.guest import metadata


def page(*words: int) -> bytes:
    return struct.pack(f"<{len(words)}Q", *words) + bytes(4096 - 8 * len(words))


GOOD = (
    7,  # pid
    0x400000,  # image_base
    0x3000,  # image_size
    0x40,  # program_headers_offset
    0x402000,  # eh_frame_address
    0x200,  # eh_frame_size
    0x401000,  # text_address
    0x800,  # text_size
)


def test_parse_reads_the_eight_fields_in_order() -> None:
    info = metadata.parse(page(*GOOD))
    assert info is not None
    assert (info.pid, info.image_base, info.text_address, info.text_size) == (
        7,
        0x400000,
        0x401000,
        0x800,
    )
    assert info.has_eh_frame


@pytest.mark.parametrize(
    "words",
    [
        (0,) * 8,  # a zero page: kernel thread or no convention
        (*GOOD[:6], 0x500000, 0x800),  # text outside the image
        (*GOOD[:2], 1 << 40, *GOOD[3:]),  # absurd image size
        (*GOOD[:5], 0x10000, *GOOD[6:]),  # eh_frame larger than the image
    ],
)
def test_parse_rejects_implausible_pages(words: tuple[int, ...]) -> None:
    assert metadata.parse(page(*words)) is None


def test_parse_rejects_short_data() -> None:
    assert metadata.parse(page(*GOOD)[:63]) is None


def test_custom_layout_reorders_and_skips_words() -> None:
    layout = metadata.parse_layout("_," + ",".join(reversed(metadata.FIELDS)))
    info = metadata.parse(page(0xDEAD, *reversed(GOOD)), layout)
    assert info == metadata.parse(page(*GOOD))


@pytest.mark.parametrize("text", ["pid,bogus", "pid,image_base"])
def test_bad_layouts_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="metadata layout"):
        metadata.parse_layout(text)
