"""QEMU's x86 register formats read into the model's Registers: the monitor's ``info registers``
text (captured from QEMU 7.2 in tests/data/hmp/: SeaBIOS at reset (real mode) and idle (32-bit
protected mode), OVMF (64-bit long mode)) and the gdbstub's ``g`` packets (captured, and built by
hand). A vCPU outside long mode reads as i386 (its DWARF numbers), one in long mode as x86_64."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from monitortext import monitor_fields

from qmpprof.arch.x86regs import REGISTER_NAMES, X86Formats
from qmpprof.errors import TransportError
from qmpprof.model import Registers

DATA = Path(__file__).parents[1] / "data" / "hmp"
FORMATS = X86Formats()


def capture(name: str) -> str:
    # newline="" keeps QEMU's \r\n line ends as they came over QMP.
    with open(DATA / name, encoding="ascii", newline="") as f:
        return f.read()


def one(text: str) -> Registers:
    (regs,) = FORMATS.from_monitor(text)
    return regs


def test_captures_keep_crlf_line_ends() -> None:
    assert "\r\nCPU#0\r\n" in capture("ovmf-longmode-cpu0.txt")


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


def test_long_mode_layout() -> None:
    regs = one(capture("ovmf-longmode-cpu0.txt"))
    assert regs.cpu == 0 and regs.isa == "x86_64" and not regs.halted
    assert regs.pc == 0x704A357 and regs.sp == 0x7EEA690 and regs.fp == 0
    assert regs.space == 0x7801000 and regs.special["cpl"] == 0
    # DWARF numbering: rax 0, rdx 1, rcx 2, rbx 3, rsi 4, rdi 5; "R8 =" has a space.
    assert regs.gprs[0] == 0x3C2B28 and regs.gprs[1] == 0xB008 and regs.gprs[3] == 0x42BC49
    assert regs.gprs[5] == 0x369E99 and regs.gprs[8] == 0xAF and regs.gprs[14] == 1 << 63 | 6
    assert regs.gprs[15] == 0x7EEA7F8 and regs.gprs[16] == regs.pc and regs.gprs[7] == regs.sp
    assert sorted(regs.gprs) == list(range(17))


def test_real_mode_layout_at_reset() -> None:
    regs = one(capture("seabios-realmode-cpu0.txt"))
    assert regs.isa == "i386"
    assert regs.pc == 0xFFF0 and regs.sp == 0 and regs.gprs[2] == 0x60FB1  # EDX: CPUID sig
    assert sorted(regs.gprs) == list(range(9))  # i386's: eax ecx edx ebx esp ebp esi edi eip


def test_protected_mode_layout_with_segment_bases_and_hlt() -> None:
    regs = one(capture("seabios-protmode-cpu0.txt"))
    assert regs.isa == "i386" and regs.halted
    assert regs.pc == 0x12839 and regs.sp == 0xA1FBC and regs.fp == 0x9CCC2F10
    assert regs.special["fs_base"] == 0x7F3D000 and regs.special["gs_base"] == 0x7F3D000
    assert regs.gprs[1] == 0xF815F480  # ECX (i386's DWARF 1)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("seabios-smp2-all.txt", [(0, 0x12839, False, True), (1, 0xFD09A, False, True)]),
        ("ovmf-smp2-all.txt", [(0, 0x704A357, True, False), (1, 0x7031DC1, True, True)]),
    ],
)
def test_info_registers_all_cpus(name: str, expected: list[tuple[int, int, bool, bool]]) -> None:
    found = [
        (r.cpu, r.pc, r.isa == "x86_64", r.halted) for r in FORMATS.from_monitor(capture(name))
    ]
    assert found == expected


def test_not_register_text() -> None:
    with pytest.raises(TransportError, match="not 'info registers'"):
        one("Parameter 'cpu-index' expects a CPU number\r\n")


def test_missing_register_is_reported() -> None:
    text = capture("ovmf-longmode-cpu0.txt").replace("RSP=", "RSQ=")
    with pytest.raises(TransportError, match="rsp missing"):
        one(text)


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
    regs = one(text)
    assert (regs.pc, regs.sp, regs.fp) == (0x40108C, 0x7FFFC0, 0x7FFFD8)
    assert (regs.special["cpl"], regs.space, regs.isa == "x86_64") == (3, 0x121000, False)
    assert (regs.gprs[0], regs.gprs[3], regs.gprs[1]) == (0xD0A16BF4, 0x17AC, 0x42493A41)


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
    regs = one(text)
    assert (regs.special["cpl"], regs.space, regs.isa == "x86_64") == (3, 0x10F060, False)


def test_captured_registers_agree_with_info_registers() -> None:
    regs = FORMATS.gdb_named(CAPTURED_G)
    mon = monitor_fields(CAPTURED_INFO_REGISTERS)
    for name in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip"):
        assert regs["r" + name] == mon["E" + name.upper()], name
    assert regs["eflags"] == mon["EFL"]
    assert regs["cs"] == mon["CS"]
    assert (regs["cr0"], regs["cr3"], regs["efer"]) == (mon["CR0"], mon["CR3"], mon["EFER"])
    assert regs["fs_base"] == 0x03F3D000  # the base column of the FS line


def test_captured_registers_fill_the_model() -> None:
    model = FORMATS.from_gdb(0, CAPTURED_G)
    assert (model.pc, model.sp, model.fp) == (0x12839, 0xA1FBC, 0x9CCC2F10)
    # Outside long mode, in i386's DWARF numbers: eax ecx edx ebx esp ebp esi edi eip.
    assert model.gprs[2] == 0x10246  # edx
    assert model.gprs[3] == 0x800  # ebx
    assert model.gprs[1] == 0xFC15F480  # ecx
    assert model.special["cpl"] == 0
    assert model.isa == "i386"
    assert model.special["fs_base"] == 0x03F3D000


def test_long_mode_user_registers_by_hand() -> None:
    # gdb order rax rbx rcx rdx ...: value 0x1000+i at gdb position i tells the mapping apart.
    gprs = [0xFFFF_8000_0000_1000 + i for i in range(16)]
    rip = 0x40_1234
    segments = [0x202, 0x33, 0x2B, 0, 0, 0, 0]  # eflags, then CS with RPL 3 (user)
    tail = [0x7000, 0xFFFF_8880_0000_0000, 0, 0x8005_0033, 0, 0x1234_5000, 0x20, 0, 0xD01]
    raw = struct.pack("<17Q7I9Q", *gprs, rip, *segments, *tail) + bytes(372)
    model = FORMATS.from_gdb(1, raw.hex().encode())
    assert model.cpu == 1
    assert model.gprs[0] == gprs[0]  # rax
    assert model.gprs[1] == gprs[3]  # rdx
    assert model.gprs[2] == gprs[2]  # rcx
    assert model.gprs[3] == gprs[1]  # rbx
    assert [model.gprs[n] for n in range(4, 16)] == gprs[4:]
    assert (model.gprs[16], model.pc) == (rip, rip)
    assert (model.special["cpl"], model.space, model.isa == "x86_64") == (3, 0x1234_5000, True)
    assert (model.special["fs_base"], model.special["gs_base"]) == (0x7000, 0xFFFF_8880_0000_0000)


@pytest.mark.parametrize("payload", [b"00" * 100, b"zz" * 608])
def test_malformed_register_packets_are_transport_errors(payload: bytes) -> None:
    with pytest.raises(TransportError):
        FORMATS.from_gdb(0, payload)


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
    model = FORMATS.from_gdb(0, raw.hex().encode())
    assert (model.pc, model.sp, model.fp) == (eip, 0x1004, 0x1005)
    assert (model.special["cpl"], model.space, model.isa == "x86_64") == (3, 0x0012_1000, False)
    # i386's DWARF numbers are gdb's order: eax ecx edx ebx esp ebp esi edi eip.
    assert [model.gprs[n] for n in range(8)] == gprs
    assert model.gprs[8] == eip


def test_the_idt_register_is_read_from_the_monitor() -> None:
    # A Linux kernel's IDT, in the CPU entry area (qmpprof.linux.running.slide reads its gates).
    text = (
        "CPU#0\r\n"
        "RAX=0000000000000000 RBX=0000000000000000 RCX=0000000000000000 RDX=0000000000000000\r\n"
        "RSI=0000000000000000 RDI=0000000000000000 RBP=0000000000000000 RSP=ffffc90000003e00\r\n"
        "RIP=ffffffff81000010 RFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=0\r\n"
        "GDT=     fffffe0000001000 0000007f\r\n"
        "IDT=     fffffe0000000000 00000fff\r\n"
        "CR0=80050033 CR2=00007f0000000000 CR3=0000000002a0e000 CR4=000006f0\r\n"
    )
    special = one(text).special
    assert (special["idt_base"], special["idt_limit"]) == (0xFFFFFE0000000000, 0xFFF)
    assert "idt_base" not in one(text.replace("IDT=", "XDT=")).special


@pytest.mark.parametrize(
    ("name", "paging"),
    [
        ("seabios-realmode-cpu0.txt", 0),  # CR0=60000010: real mode
        ("seabios-protmode-cpu0.txt", 0),  # SeaBIOS's 32-bit code: protected, flat, no paging
        ("ovmf-longmode-cpu0.txt", 1),  # CR0=80010033
    ],
)
def test_the_monitor_text_says_whether_the_vcpu_pages(name: str, paging: int) -> None:
    text = capture(name)
    cr0 = int(re.search(r"CR0=([0-9a-f]+)", text)[1], 16)  # type: ignore[index]
    assert one(text).special["paging"] == paging == cr0 >> 31


def test_the_g_packet_says_whether_the_vcpu_pages() -> None:
    assert FORMATS.gdb_named(CAPTURED_G)["cr0"] == 0x11  # the monitor's CR0 of that stop
    assert FORMATS.from_gdb(0, CAPTURED_G).special["paging"] == 0
