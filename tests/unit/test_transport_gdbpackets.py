"""The pure packet code of the gdbstub transport: framing, checksums, escaping, run-length
decoding, thread lists, the target description's architecture, checked on captured real packets
and on packets built by hand."""

from __future__ import annotations

import pytest

from qmpprof.errors import TransportError
from qmpprof.transport.gdbpackets import (
    architecture,
    checksum,
    decode_body,
    encode_packet,
    includes,
    numbered,
    parse_thread_ids,
)

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


def test_architecture_of_a_target_description() -> None:
    xml = '<?xml version="1.0"?><target><architecture>i386:x86-64</architecture></target>'
    assert architecture(xml) == "i386:x86-64"
    assert architecture("<target></target>") is None


# Pieces of what qemu-system-aarch64 7.2 sent (-cpu max): target.xml and system-registers.xml.
AARCH64_TARGET = (
    '<?xml version="1.0"?><!DOCTYPE target SYSTEM "gdb-target.dtd"><target><architecture>'
    'aarch64</architecture><xi:include href="aarch64-core.xml"/><xi:include href="sve-regi'
    'sters.xml"/><xi:include href="system-registers.xml"/></target>'
)
AARCH64_SYSREGS = (
    '<?xml version="1.0"?><!DOCTYPE target SYSTEM "gdb-target.dtd"><feature name="org.qemu.'
    'gdb.arm.sys.regs"><reg name="ID_MMFR5" bitsize="64" regnum="86" group="cp_regs"/><reg '
    'name="SP_EL0" bitsize="64" regnum="138" group="cp_regs"/><reg name="TCR_EL1" bitsize="64"'
    ' regnum="174" group="cp_regs"/><reg name="TTBR1_EL1" bitsize="64" regnum="175" group="cp'
    '_regs"/></feature>'
)


def test_included_annexes_of_a_target_description() -> None:
    assert includes(AARCH64_TARGET) == [
        "aarch64-core.xml",
        "sve-registers.xml",
        "system-registers.xml",
    ]
    assert includes("<target></target>") == []


RISCV64_FEATURES = [  # qemu-system-riscv64 7.2's (-M virt), shortened: what counts is order
    '<feature name="org.gnu.gdb.riscv.cpu">'
    + "".join(f'<reg name="x{n}" bitsize="64" type="int"/>' for n in range(32))
    + '<reg name="pc" bitsize="64" type="code_ptr"/></feature>',
    "".join(f'<reg name="ft{n}" bitsize="64" type="riscv_double"/>' for n in range(32)),
    '<feature name="org.gnu.gdb.riscv.virtual"><reg name="priv" bitsize="64"/></feature>',
    '<reg name="sstatus" bitsize="64" regnum="322"/><reg name="satp" bitsize="64" regnum="449"/>'
    '<reg name="mstatus" bitsize="64" regnum="833"/><reg name="mepc" bitsize="64" regnum="898"/>',
]


def test_registers_numbered_by_their_description() -> None:
    numbers = numbered([AARCH64_SYSREGS])
    assert numbers == {"ID_MMFR5": 86, "SP_EL0": 138, "TCR_EL1": 174, "TTBR1_EL1": 175}
    # Registers without regnum are numbered by their place, from 0 across the features (QEMU
    # 7.2's riscv64 priv: p41 read 3, M-mode, at the reset vector).
    riscv = numbered(RISCV64_FEATURES)
    assert (riscv["x0"], riscv["pc"], riscv["ft0"], riscv["priv"]) == (0, 32, 33, 65)
    assert (riscv["sstatus"], riscv["satp"]) == (322, 449)
    # After a feature that did not read, places are unknown until a regnum says.
    unread = numbered([RISCV64_FEATURES[0], None, *RISCV64_FEATURES[2:]])
    assert "priv" not in unread and unread["pc"] == 32 and unread["satp"] == 449
    # A regnum sets the number of the registers after it too.
    assert numbered(['<reg name="a" regnum="7"/><reg name="b"/>']) == {"a": 7, "b": 8}
