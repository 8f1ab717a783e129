"""The pure packet code of the gdbstub transport: framing, checksums, escaping, run-length
decoding, thread lists and QEMU's x86_64 register layout, checked on captured real packets and on
packets built by hand."""

from __future__ import annotations

import re
import struct

import pytest

from qmpprof.errors import TransportError
from qmpprof.transport.gdbpackets import (
    REGISTER_NAMES,
    checksum,
    decode_body,
    decode_registers,
    encode_packet,
    parse_registers,
    parse_thread_ids,
)

# Captured from QEMU 7.2 (SeaBIOS idle in 32-bit protected mode): the `g` reply and the
# `info registers` text of the same stop.
CAPTURED_G = (
    "0000000000000000000800000000000080f415fc000000004602010000000000"
    "e8300003000000000008000000000000102fcc9c00000000bc1f0a"
    + "0"
    * 138
    + "3928010000000000460200000800000010000000100000001000000010000000"
    "1000000000d0f3030000000000d0f30300000000000000000000000011"
    + "0" * 254
    + "7f03"  # the x87 control word (FCW=037f)
    + "0" * 572
    + "801f0000"  # MXCSR=00001f80, the last register
).encode()
CAPTURED_INFO_REGISTERS = """\
EAX=00000000 EBX=00000800 ECX=fc15f480 EDX=00010246
ESI=030030e8 EDI=00000800 EBP=9ccc2f10 ESP=000a1fbc
EIP=00012839 EFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=1
CS =0008 03f3d000 ffffffff 00cf9f00 DPL=0 CS32 [CRA]
FS =0010 03f3d000 ffffffff 00cf9300 DPL=0 DS   [-WA]
CR0=00000011 CR2=00000000 CR3=00000000 CR4=00000000
EFER=0000000000000000
"""


def monitor_fields(text: str) -> dict[str, int]:
    """NAME=hex fields of `info registers`, first occurrence wins (the witness's own parser)."""
    fields: dict[str, int] = {}
    for name, value in re.findall(r"\b([A-Z][A-Z0-9]*) ?=([0-9a-f]+)\b", text):
        fields.setdefault(name, int(value, 16))
    return fields


# --- framing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "framed",
    [
        b"$PacketSize=1000;qXfer:features:read+;vContSupported+;multiprocess+#92",
        b"$OK#9a",
        b"$T05thread:p01.01;#06",
        b"$mp01.01#cd",
        b"$vCont;c;C;s;S#62",
    ],
)
def test_checksum_matches_captured_packets(framed: bytes) -> None:
    body, _, cs = framed[1:].partition(b"#")
    assert checksum(body) == int(cs, 16)
    assert encode_packet(body) == framed


@pytest.mark.parametrize("size", [0, 1, 255, 256, 257, 4096, 4097, 70_000])
def test_checksum_of_long_bodies_is_the_byte_sum_modulo_256(size: int) -> None:
    # Sliced sums: every length around the slice size, bytes as large as they come.
    body = bytes((i * 131 + 255) & 0xFF for i in range(size)).replace(b"\x00", b"\xff")
    assert checksum(body) == sum(body) % 256


def test_escaping_round_trips_reserved_bytes() -> None:
    body = b"a$b#c}d*e"
    framed = encode_packet(body)
    # Each reserved byte becomes `}` followed by the byte XOR 0x20.
    assert framed[1:-3] == b"a}\x04b}\x03c}]d}\x0ae"
    assert int(framed[-2:], 16) == checksum(framed[1:-3])
    assert decode_body(framed[1:-3]) == body


@pytest.mark.parametrize(
    ("encoded", "decoded"),
    [
        (b"0* ", b"0000"),  # the spec's example: ' ' is 32, so three more copies
        (b'ab*"c', b"abbbbbbc"),  # '"' is 34: five more
        (b"plain", b"plain"),
    ],
)
def test_run_length_decoding(encoded: bytes, decoded: bytes) -> None:
    assert decode_body(encoded) == decoded


@pytest.mark.parametrize(
    ("reply", "tids"),
    [
        (b"m01", {1: b"01"}),
        (b"m1,2,a", {1: b"1", 2: b"2", 10: b"a"}),
        (b"mp01.01,p01.02", {1: b"p01.01", 2: b"p01.02"}),  # after a multiprocess+ gdb
        (b"l", {}),
        (b"", {}),
    ],
)
def test_thread_lists(reply: bytes, tids: dict[int, bytes]) -> None:
    assert parse_thread_ids(reply) == tids


def test_malformed_thread_list_is_a_transport_error() -> None:
    with pytest.raises(TransportError):
        parse_thread_ids(b"mzz")


# --- registers ---------------------------------------------------------------------------------


def test_captured_registers_agree_with_info_registers() -> None:
    regs = decode_registers(CAPTURED_G)
    mon = monitor_fields(CAPTURED_INFO_REGISTERS)
    for name in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip"):
        assert regs["r" + name] == mon["E" + name.upper()], name
    assert regs["eflags"] == mon["EFL"]
    assert regs["cs"] == mon["CS"]
    assert (regs["cr0"], regs["cr3"], regs["efer"]) == (mon["CR0"], mon["CR3"], mon["EFER"])
    assert regs["fs_base"] == 0x03F3D000  # the base column of the FS line


def test_captured_registers_fill_the_model() -> None:
    model = parse_registers(0, CAPTURED_G)
    assert (model.rip, model.rsp, model.rbp) == (0x12839, 0xA1FBC, 0x9CCC2F10)
    assert model.gprs[1] == 0x10246  # DWARF 1 is rdx
    assert model.gprs[3] == 0x800  # DWARF 3 is rbx
    assert model.gprs[2] == 0xFC15F480  # rcx
    assert model.cpl == 0
    assert model.long_mode is False
    assert model.fs_base == 0x03F3D000


def test_long_mode_user_registers_by_hand() -> None:
    # gdb order rax rbx rcx rdx ...: value 0x1000+i at gdb position i tells the mapping apart.
    gprs = [0xFFFF_8000_0000_1000 + i for i in range(16)]
    rip = 0x40_1234
    segments = [0x202, 0x33, 0x2B, 0, 0, 0, 0]  # eflags, then CS with RPL 3 (user)
    tail = [0x7000, 0xFFFF_8880_0000_0000, 0, 0x8005_0033, 0, 0x1234_5000, 0x20, 0, 0xD01]
    raw = struct.pack("<17Q7I9Q", *gprs, rip, *segments, *tail) + bytes(372)
    model = parse_registers(1, raw.hex().encode())
    assert model.cpu == 1
    assert model.gprs[0] == gprs[0]  # rax
    assert model.gprs[1] == gprs[3]  # rdx
    assert model.gprs[2] == gprs[2]  # rcx
    assert model.gprs[3] == gprs[1]  # rbx
    assert [model.gprs[n] for n in range(4, 16)] == gprs[4:]
    assert (model.gprs[16], model.rip) == (rip, rip)
    assert (model.cpl, model.cr3, model.long_mode) == (3, 0x1234_5000, True)
    assert (model.fs_base, model.gs_base) == (0x7000, 0xFFFF_8880_0000_0000)


@pytest.mark.parametrize("payload", [b"00" * 100, b"zz" * 608])
def test_malformed_register_packets_are_transport_errors(payload: bytes) -> None:
    with pytest.raises(TransportError):
        parse_registers(0, payload)


def test_register_names_cover_the_parsed_prefix() -> None:
    assert len(REGISTER_NAMES) == 33
    assert REGISTER_NAMES[16:18] == ("rip", "eflags")


def test_i386_layout_by_hand() -> None:
    # qemu-system-i386: eax ecx edx ebx esp ebp esi edi eip, then eflags and segments, the three
    # bases and cr0 cr2 cr3 cr4 cr8 efer, all 4 bytes; x87/SSE pad the reply to 344 bytes.
    gprs = [0x1000 + i for i in range(8)]  # eax ecx edx ebx esp ebp esi edi
    eip = 0x0040_108C
    segments = [0x282, 0x23, 0x2B, 0x1B, 0x1B, 0x1B, 0x1B]
    tail = [0, 0, 0, 0x8001_0011, 0, 0x0012_1000, 0x10, 0, 0]
    raw = struct.pack("<25I", *gprs, eip, *segments, *tail)
    raw += bytes(344 - len(raw))
    model = parse_registers(0, raw.hex().encode())
    assert (model.rip, model.rsp, model.rbp) == (eip, 0x1004, 0x1005)
    assert (model.cpl, model.cr3, model.long_mode) == (3, 0x0012_1000, False)
    # The model's DWARF numbers are x86_64's: rax rdx rcx rbx rsi rdi rbp rsp.
    dwarf = [model.gprs[n] for n in range(8)]
    assert dwarf == [0x1000, 0x1002, 0x1001, 0x1003, 0x1006, 0x1007, 0x1005, 0x1004]
    assert model.gprs[16] == eip
