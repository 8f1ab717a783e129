"""HMP text parsers, on monitor output captured from QEMU 7.2 (tests/data/hmp/):
SeaBIOS at reset (real mode) and idle (32-bit protected mode), OVMF (64-bit long mode)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qmpprof.errors import MemoryReadError, TransportError
from qmpprof.transport import hmp

DATA = Path(__file__).parent / "data" / "hmp"


def capture(name: str) -> str:
    # newline="" keeps QEMU's \r\n line ends as they came over QMP.
    with open(DATA / name, encoding="ascii", newline="") as f:
        return f.read()


def test_captures_keep_crlf_line_ends() -> None:
    assert "\r\nCPU#0\r\n" in capture("ovmf-longmode-cpu0.txt")


def test_long_mode_layout() -> None:
    regs = hmp.parse_registers(capture("ovmf-longmode-cpu0.txt"))
    assert regs.cpu == 0 and regs.long_mode and not regs.halted
    assert regs.rip == 0x704A357 and regs.rsp == 0x7EEA690 and regs.rbp == 0
    assert regs.cr3 == 0x7801000 and regs.cpl == 0
    # DWARF numbering: rax 0, rdx 1, rcx 2, rbx 3, rsi 4, rdi 5; "R8 =" has a space.
    assert regs.gprs[0] == 0x3C2B28 and regs.gprs[1] == 0xB008 and regs.gprs[3] == 0x42BC49
    assert regs.gprs[5] == 0x369E99 and regs.gprs[8] == 0xAF and regs.gprs[14] == 1 << 63 | 6
    assert regs.gprs[15] == 0x7EEA7F8 and regs.gprs[16] == regs.rip and regs.gprs[7] == regs.rsp
    assert sorted(regs.gprs) == list(range(17))


def test_real_mode_layout_at_reset() -> None:
    regs = hmp.parse_registers(capture("seabios-realmode-cpu0.txt"))
    assert not regs.long_mode
    assert regs.rip == 0xFFF0 and regs.rsp == 0 and regs.gprs[1] == 0x60FB1  # EDX: CPUID sig
    assert sorted(regs.gprs) == [0, 1, 2, 3, 4, 5, 6, 7, 16]


def test_protected_mode_layout_with_segment_bases_and_hlt() -> None:
    regs = hmp.parse_registers(capture("seabios-protmode-cpu0.txt"))
    assert not regs.long_mode and regs.halted
    assert regs.rip == 0x12839 and regs.rsp == 0xA1FBC and regs.rbp == 0x9CCC2F10
    assert regs.fs_base == 0x7F3D000 and regs.gs_base == 0x7F3D000
    assert regs.gprs[2] == 0xF815F480  # ECX


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("seabios-smp2-all.txt", [(0, 0x12839, False, True), (1, 0xFD09A, False, True)]),
        ("ovmf-smp2-all.txt", [(0, 0x704A357, True, False), (1, 0x7031DC1, True, True)]),
    ],
)
def test_info_registers_all_cpus(name: str, expected: list[tuple[int, int, bool, bool]]) -> None:
    found = [(r.cpu, r.rip, r.long_mode, r.halted) for r in hmp.parse_all_registers(capture(name))]
    assert found == expected


def test_one_cpu_parser_refuses_several() -> None:
    with pytest.raises(TransportError, match="found 2"):
        hmp.parse_registers(capture("ovmf-smp2-all.txt"))


def test_not_register_text() -> None:
    with pytest.raises(TransportError, match="not 'info registers'"):
        hmp.parse_registers("Parameter 'cpu-index' expects a CPU number\r\n")


def test_missing_register_is_reported() -> None:
    text = capture("ovmf-longmode-cpu0.txt").replace("RSP=", "RSQ=")
    with pytest.raises(TransportError, match="RSP missing"):
        hmp.parse_registers(text)


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


def test_32_bit_layout_of_qemu_system_x86_64() -> None:
    # docs/i386.md: the i386 guest in user mode under qemu-system-x86_64 (wide debug registers).
    text = (
        "CPU#0\r\n"
        "EAX=d0a16bf4 EBX=000017ac ECX=42493a41 EDX=00000000\r\n"
        "ESI=00000000 EDI=00000000 EBP=007fffd8 ESP=007fffc0\r\n"
        "EIP=0040108c EFL=00000282 [--S----] CPL=3 II=0 A20=1 SMM=0 HLT=0\r\n"
        "ES =001b 00000000 ffffffff 00cff300 DPL=3 DS   [-WA]\r\n"
        "CS =0023 00000000 ffffffff 00cffa00 DPL=3 CS32 [-R-]\r\n"
        "CR0=80010011 CR2=00000000 CR3=00121000 CR4=00000010\r\n"
        "DR0=0000000000000000 DR1=0000000000000000 DR2=0000000000000000 DR3=0000000000000000\r\n"
        "DR6=00000000ffff0ff0 DR7=0000000000000400\r\n"
        "EFER=0000000000000000\r\n"
    )
    regs = hmp.parse_registers(text)
    assert (regs.rip, regs.rsp, regs.rbp) == (0x40108C, 0x7FFFC0, 0x7FFFD8)
    assert (regs.cpl, regs.cr3, regs.long_mode) == (3, 0x121000, False)
    assert (regs.gprs[0], regs.gprs[3], regs.gprs[2]) == (0xD0A16BF4, 0x17AC, 0x42493A41)


def test_pae_cr3_keeps_bits_5_to_11() -> None:
    # docs/i386.md: the i386-pae guest in user mode under qemu-system-i386. CR3 holds a PDPT's
    # address, 32-byte aligned: the low bits are what tell this build's processes apart.
    text = (
        "CPU#0\r\n"
        "EAX=9ae1e0d4 EBX=000004c6 ECX=a8c36521 EDX=00000000\r\n"
        "ESI=00000000 EDI=00000000 EBP=007fffd8 ESP=007fffc0\r\n"
        "EIP=0040108c EFL=00000286 [--S--P-] CPL=3 II=0 A20=1 SMM=0 HLT=0\r\n"
        "CS =0023 00000000 ffffffff 00cffa00 DPL=3 CS32 [-R-]\r\n"
        "CR0=80010011 CR2=00000000 CR3=0010f060 CR4=00000020\r\n"
        "EFER=0000000000000000\r\n"
    )
    regs = hmp.parse_registers(text)
    assert (regs.cpl, regs.cr3, regs.long_mode) == (3, 0x10F060, False)
