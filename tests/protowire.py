"""The protobuf wire format at the level of fields, for tests that build profile.proto bytes by
hand or take them apart to damage them (the ``protobuf`` runtime writes only well-formed
messages): varints, length-delimited fields (strings, bytes, nested messages) and packed
repeated integers.

A message is built field by field into a ``Message`` and turned into bytes once; a nested
message is added as the bytes of its own ``Message``. Fields equal to their default (0, "")
are left out, as proto3 writers do. uint64 values cover the whole 64-bit range (a kernel
address is a ten-byte varint); int64 values may be negative (two's complement, ten bytes), so
an address is never passed as an int64.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cache

VARINT = 0
LEN = 2
_U64 = 1 << 64
_I64_MIN = -(1 << 63)
_ONE_BYTE = tuple(bytes((i,)) for i in range(0x80))  # most ids, counts and string indices


def varint(value: int) -> bytes:
    """``value`` (0 <= value < 2**64) as a base-128 varint, least significant group first."""
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    if not 0 <= value < _U64:
        raise ValueError(f"not a uint64: {value}")
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def int64(value: int) -> int:
    """An int64 as the uint64 the wire carries (negative values wrap, as protobuf does)."""
    if not _I64_MIN <= value < -_I64_MIN:
        raise ValueError(f"not an int64: {value}")
    return value % _U64


@cache
def key(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


class Message:
    """One message's fields in the order they were added."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u64(self, field: int, value: int) -> Message:
        """A uint64 (or bool, or non-negative int64) field; left out when 0."""
        if value:
            self._parts += (key(field, VARINT), varint(value))
        return self

    def i64(self, field: int, value: int) -> Message:
        """An int64 field, possibly negative; left out when 0."""
        return self.u64(field, int64(value))

    def raw(self, field: int, data: bytes) -> Message:
        """A length-delimited field, always written (a repeated string may be empty)."""
        self._parts += (key(field, LEN), varint(len(data)), data)
        return self

    def string(self, field: int, text: str) -> Message:
        # Names come from guest bytes: a lone surrogate becomes "?", never an error.
        return self.raw(field, text.encode("utf-8", "replace"))

    def message(self, field: int, inner: Message) -> Message:
        return self.raw(field, inner.encode())

    def packed(self, field: int, values: Iterable[int]) -> Message:
        """A packed repeated uint64 field (int64 values: pass them through ``int64``)."""
        data = b"".join(varint(v) for v in values)
        if data:
            self.raw(field, data)
        return self

    def encode(self) -> bytes:
        return b"".join(self._parts)


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of a message: varints as ints,
    length-delimited fields as bytes, fixed-size ones as ints. Raises ValueError."""
    pos, end = 0, len(data)
    while pos < end:
        field, pos = _read_varint(data, pos)
        number, wire = field >> 3, field & 7
        if wire == VARINT:
            value, pos = _read_varint(data, pos)
            yield number, wire, value
        elif wire == LEN:
            size, pos = _read_varint(data, pos)
            if pos + size > end:
                raise ValueError(f"field {number} runs past the end")
            yield number, wire, data[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise ValueError(f"field {number} runs past the end")
            yield number, wire, int.from_bytes(data[pos : pos + size], "little")
            pos += size
        else:
            raise ValueError(f"wire type {wire} of field {number}")


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("a varint runs past the end")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
