"""Byte-level decoding shared by the CFI parser and the DWARF expression evaluator.

LEB128 numbers, fixed-size little-endian integers and the ``DW_EH_PE_*`` pointer encodings of
the LSB (.eh_frame / .eh_frame_hdr). A Reader knows the target's address size (8 on x86_64, 4
on i386): an absolute pointer is that wide, and pointer arithmetic wraps at that width.
Malformed input raises ``CfiDecodeError``, which the callers turn into "no rule here" — never
into a crash of the sampler.
"""

from __future__ import annotations

import struct

MASK64 = (1 << 64) - 1

# DW_EH_PE_* pointer encodings: low nibble = value format, high bits = what it is relative to.
PE_OMIT = 0xFF
PE_ABSPTR = 0x00
PE_ULEB128 = 0x01
PE_UDATA2 = 0x02
PE_UDATA4 = 0x03
PE_UDATA8 = 0x04
PE_SLEB128 = 0x09
PE_SDATA2 = 0x0A
PE_SDATA4 = 0x0B
PE_SDATA8 = 0x0C
PE_PCREL = 0x10
PE_TEXTREL = 0x20
PE_DATAREL = 0x30
PE_FUNCREL = 0x40
PE_ALIGNED = 0x50
PE_INDIRECT = 0x80

_FIXED: dict[int, struct.Struct] = {
    PE_ABSPTR: struct.Struct("<Q"),
    PE_UDATA2: struct.Struct("<H"),
    PE_UDATA4: struct.Struct("<I"),
    PE_UDATA8: struct.Struct("<Q"),
    PE_SDATA2: struct.Struct("<h"),
    PE_SDATA4: struct.Struct("<i"),
    PE_SDATA8: struct.Struct("<q"),
}


class CfiDecodeError(Exception):
    """The CFI bytes are truncated or use something this decoder does not understand."""


_ADDRESS: dict[int, struct.Struct] = {4: _FIXED[PE_UDATA4], 8: _FIXED[PE_UDATA8]}


class Reader:
    """A cursor over a bytes object; ``base_addr`` is the address of ``data[0]`` (for pcrel),
    ``address_size`` the width of an absolute pointer (4 or 8)."""

    __slots__ = ("address_size", "base_addr", "data", "pos")

    def __init__(
        self, data: bytes, pos: int = 0, base_addr: int = 0, address_size: int = 8
    ) -> None:
        if address_size not in _ADDRESS:
            raise CfiDecodeError(f"address size {address_size} (only 4 and 8 are known)")
        self.data = data
        self.pos = pos
        self.base_addr = base_addr
        self.address_size = address_size

    def _take(self, size: int) -> int:
        pos = self.pos
        if size < 0 or pos < 0 or pos + size > len(self.data):
            raise CfiDecodeError(f"truncated at offset {pos:#x}")
        self.pos = pos + size
        return pos

    def u8(self) -> int:
        return self.data[self._take(1)]

    def fixed(self, fmt: struct.Struct) -> int:
        value: int = fmt.unpack_from(self.data, self._take(fmt.size))[0]
        return value

    def u16(self) -> int:
        return self.fixed(_FIXED[PE_UDATA2])

    def s16(self) -> int:
        return self.fixed(_FIXED[PE_SDATA2])

    def u32(self) -> int:
        return self.fixed(_FIXED[PE_UDATA4])

    def u64(self) -> int:
        return self.fixed(_FIXED[PE_UDATA8])

    def address(self) -> int:
        """One target address (DW_OP_addr, a .debug_frame initial location)."""
        return self.fixed(_ADDRESS[self.address_size])

    def block(self, size: int) -> bytes:
        pos = self._take(size)
        return self.data[pos : pos + size]

    def uleb(self) -> int:
        data = self.data
        pos = self.pos
        if 0 <= pos < len(data) and data[pos] < 0x80:  # most are one byte: no loop
            self.pos = pos + 1
            return data[pos]
        result = shift = 0
        while True:
            if not 0 <= pos < len(data):
                raise CfiDecodeError("truncated LEB128")
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                self.pos = pos
                return result

    def sleb(self) -> int:
        start = self.pos
        value = self.uleb()
        bits = 7 * (self.pos - start)
        if value >> (bits - 1) & 1:
            value -= 1 << bits
        return value

    def cstring(self) -> bytes:
        end = self.data.find(b"\0", self.pos)
        if end < 0 or self.pos < 0:
            raise CfiDecodeError("unterminated string")
        text = self.data[self.pos : end]
        self.pos = end + 1
        return text

    def pointer(self, encoding: int, data_addr: int = 0) -> int:
        """Decode one pointer in ``encoding``; ``data_addr`` is the base for DW_EH_PE_datarel."""
        if encoding == PE_OMIT:
            raise CfiDecodeError("omitted pointer read")
        fmt = encoding & 0x0F
        app = encoding & 0x70
        here = self.base_addr + self.pos
        if fmt == PE_ULEB128:
            value = self.uleb()
        elif fmt == PE_SLEB128:
            value = self.sleb()
        elif fmt == PE_ABSPTR:
            value = self.address()
        elif fmt in _FIXED:
            value = self.fixed(_FIXED[fmt])
        else:
            raise CfiDecodeError(f"bad pointer encoding {encoding:#x}")
        if app == PE_PCREL:
            value += here
        elif app == PE_DATAREL:
            value += data_addr
        elif app not in (0, PE_TEXTREL, PE_FUNCREL, PE_ALIGNED):
            raise CfiDecodeError(f"bad pointer encoding {encoding:#x}")
        # Indirect pointers point at the real value in memory we do not have; unwinding needs
        # only pc ranges, which gcc never encodes indirectly, so the raw address is kept.
        return value & ((1 << (8 * self.address_size)) - 1)


def pointer_size(encoding: int, address_size: int = 8) -> int:
    """Byte size of a fixed-size encoding (for .eh_frame_hdr tables); 0 if variable/invalid."""
    if encoding & 0x0F == PE_ABSPTR:
        return address_size
    fmt = _FIXED.get(encoding & 0x0F)
    return 0 if fmt is None else fmt.size
