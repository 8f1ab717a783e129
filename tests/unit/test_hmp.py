"""The monitor's ``x`` dumps, on output captured from QEMU 7.2 (tests/data/hmp/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qmpprof.errors import MemoryReadError, TransportError
from qmpprof.transport import hmp

DATA = Path(__file__).parents[1] / "data" / "hmp"


def capture(name: str) -> str:
    # newline="" keeps QEMU's \r\n line ends as they came over QMP.
    with open(DATA / name, encoding="ascii", newline="") as f:
        return f.read()


def test_x_quad_words_are_little_endian_bytes() -> None:
    data = hmp.parse_x(capture("x-4gx-ok.txt"), 0xF0000, 32)
    assert data[:8] == (0x5F5E5B20C4832443).to_bytes(8, "little")
    assert data[24:] == (0x0F068B2404890000).to_bytes(8, "little")


def test_x_at_the_stack_pointer_in_long_mode() -> None:
    data = hmp.parse_x(capture("x-sp-longmode.txt"), 0x7EEA690, 32)
    assert int.from_bytes(data[8:16], "little") == 0x206


def test_x_cannot_access_memory_is_a_read_error() -> None:
    with pytest.raises(MemoryReadError) as info:
        hmp.parse_x(capture("x-unmapped.txt"), 0xFFFF_FFFF_FFFF_0000, 16)
    assert info.value.addr == 0xFFFF_FFFF_FFFF_0000 and info.value.size == 16


def test_x_short_reply_is_a_read_error() -> None:
    with pytest.raises(MemoryReadError, match="returned 32 bytes"):
        hmp.parse_x(capture("x-4gx-ok.txt"), 0xF0000, 64)


def test_x_bytes_for_ragged_sizes() -> None:
    assert hmp.x_command(0x1000, 24) == "x/3gx 0x1000"
    assert hmp.x_command(0x1000, 5) == "x/5bx 0x1000"
    text = "0000000000001000: 0x01 0x02 0x03 0x04 0x05\r\n"
    assert hmp.parse_x(text, 0x1000, 5) == b"\x01\x02\x03\x04\x05"


def test_x_garbage_line() -> None:
    with pytest.raises(TransportError, match="unexpected line"):
        hmp.parse_x("unknown command: 'x/2gx'\r\n", 0, 16)
