"""aarch64: qemu-system-aarch64's register formats read into the model's Registers (the monitor's
``info registers`` text and vCPU 1's gdbstub ``g`` reply of the same guest, captured from QEMU 7.2
on bookworm's arm64 6.1 with ``-cpu max`` into tests/data/hmp/aarch64-linux-el1*), return
addresses stripped of pointer-authentication codes by the guest's translation settings, jumps and
calls decoded, and the frame-record walk over hand-made chains."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from test_unwind_chain import memory

from qmpprof import arch
from qmpprof.arch.aarch64 import AARCH64, tnsz
from qmpprof.arch.aarch64regs import AArch64Formats, aarch64_registers
from qmpprof.dwarf.cfi import CfiTable, Kind, Rule
from qmpprof.dwarf.program import RegRule
from qmpprof.elf.image import ElfImage
from qmpprof.errors import TransportError
from qmpprof.linux.aarch64.running import AARCH64 as AARCH64_LINUX
from qmpprof.model import Mapping, Registers, StopReason
from qmpprof.unwind.chain import AddressSpace, Module, Unwinder, Via
from qmpprof.unwind.steps import CfiStep

DATA = Path(__file__).parents[1] / "data" / "hmp"
FORMATS = AArch64Formats()
# TCR_EL1 of bookworm's 6.1 under QEMU 7.2 -cpu max: T0SZ = T1SZ = 16 (48-bit halves).
TCR_48 = 0x10 | 0x10 << 16


def capture(name: str) -> str:
    with open(DATA / name, encoding="ascii", newline="") as f:
        return f.read()


def test_monitor_text_gives_every_vcpu() -> None:
    cpu0, cpu1 = FORMATS.from_monitor(capture("aarch64-linux-el1.txt"))
    assert (cpu0.cpu, cpu0.isa, cpu0.user) == (0, "aarch64", False)
    assert cpu0.pc == 0xFFFF_A735_944E_9D4C
    assert cpu0.sp == cpu0.fp == 0xFFFF_8000_0800_3D50
    assert cpu0.gprs[30] == 0xAFE5_A735_938D_5AC4  # signed: a PAC in the top bits
    assert cpu0.gprs[1] == 0x40100
    assert len(cpu0.gprs) == 33
    assert cpu0.special == {"el": 1, "pstate": 0x004000C5}
    assert (cpu1.cpu, cpu1.pc, cpu1.special["el"]) == (1, 0xFFFF_A735_9420_0DD0, 1)


def test_monitor_text_of_user_mode() -> None:
    text = capture("aarch64-linux-el1.txt").replace("004000c5 ---- EL1h", "80000000 N--- EL0t")
    assert FORMATS.from_monitor(text)[0].user


def test_monitor_text_with_pstate_and_el_disagreeing_is_refused() -> None:
    text = capture("aarch64-linux-el1.txt").replace("---- EL1h", "---- EL0t")
    with pytest.raises(TransportError, match="CPU#0: PSTATE and EL0 disagree"):
        FORMATS.from_monitor(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Error: no CPU", "not 'info registers' output"),
        ("CPU#0\r\n PC=ffff000000001000 SP=ffff000000002000\r\nPSTATE=000003c5", "x29 missing"),
        ("CPU#0\r\n PC=ffff000000001000 SP=ffff000000002000 X29=0\r\n", "PSTATE missing"),
    ],
)
def test_bad_monitor_text_is_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(TransportError, match=message):
        FORMATS.from_monitor(text)


def test_gdb_reply_in_the_core_layout() -> None:
    regs = FORMATS.from_gdb(1, capture("aarch64-linux-el1-cpu1.g").encode())
    assert regs.pc == 0xFFFF_A735_9381_0C80
    assert regs.sp == 0xFFFF_8000_086C_C000
    assert regs.gprs[0] == 0x0C53_590A
    assert regs.special["el"] == 1 and not regs.user


def test_gdb_reply_built_by_hand() -> None:
    words = [n * 0x100 for n in range(31)] + [0x7FFF_F000, 0x40_1000]
    payload = struct.pack("<33QI", *words, 0x8000_0000).hex().encode()
    regs = FORMATS.from_gdb(0, payload)
    assert (regs.pc, regs.sp, regs.fp, regs.user) == (0x40_1000, 0x7FFF_F000, 29 * 0x100, True)


@pytest.mark.parametrize(
    ("payload", "message"),
    [(b"zz", "malformed"), (b"00" * 100, "100 bytes, expected at least 268")],
)
def test_bad_gdb_reply_is_one_clear_error(payload: bytes, message: str) -> None:
    with pytest.raises(TransportError, match=message):
        FORMATS.from_gdb(0, payload)


def test_registered_by_elf_machine_and_qemu_target() -> None:
    assert arch.by_elf(183, 64) is AARCH64
    assert arch.by_name("aarch64") is AARCH64
    assert isinstance(arch.formats("aarch64"), AArch64Formats)


def test_translation_sizes_from_tcr_el1() -> None:
    assert tnsz(TCR_48) == (16, 16)
    # Bits around the fields set: T0SZ is 5..0, T1SZ 21..16 only.
    assert tnsz(0xFFFF_FFFF_FFC0_FFC0 | 12 << 16 | 25) == (25, 12)


def test_pac_stripped_by_the_translation_settings() -> None:
    a48 = AARCH64.translated({"TCR_EL1": TCR_48})
    assert a48.return_address(0xAFE5_A735_938D_5AC4) == 0xFFFF_A735_938D_5AC4
    assert a48.return_address(0x3CC9_A735_9397_44B4) == 0xFFFF_A735_9397_44B4
    assert a48.return_address(0xFFFF_A735_938D_5AC4) == 0xFFFF_A735_938D_5AC4
    assert a48.return_address(0x002A_0000_0040_1000) == 0x40_1000  # a user one (bit 55 clear)
    # 52-bit halves (T1SZ 12): bits 51..48 are address, not code.
    a52 = AARCH64.translated({"TCR_EL1": 12 | 12 << 16})
    assert a52.return_address(0x8AF5_A735_938D_5AC4) == 0xFFF5_A735_938D_5AC4
    assert a52.return_address(0x0A05_0000_0040_1000) == 0x5_0000_0040_1000


class OneRow:
    """A CFI table of one row, for every pc."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule

    def row_for(self, pc: int) -> Rule:
        return self.rule


def test_a_user_return_address_signed_in_a_cfi_row_is_stripped() -> None:
    # Issue 35: unstable's liblzma (PAC on) saved x30 signed; the CFI step gave it as the pc.
    # x29 at CFA-32, x30 at CFA-24 (stp x29, x30, [sp, #-32]!), by the fast path and the
    # general one.
    a48 = AARCH64.translated({"TCR_EL1": TCR_48})
    sp, signed = 0xFFFF_E2A0_1000, 0x0010_FFFF_B8D3_74B0
    words = {sp: 0xFFFF_E2A0_1100, sp + 8: signed}
    saved = ((29, RegRule(Kind.OFFSET, -32)), (30, RegRule(Kind.OFFSET, -24)))
    fast = Rule(0, 1 << 48, 31, 32, None, saved, 30, False, ((29, -32), (30, -24)))
    for rule in (fast, replace(fast, saved_at=None)):
        step = CfiStep(cast(CfiTable, OneRow(rule)), 0, a48)
        found = step.step({31: sp, 32: 0xAAAA_0000_1234}, 0xAAAA_0000_1234, True, memory(words))
        assert isinstance(found, tuple)
        assert found[0][32] == 0xFFFF_B8D3_74B0 and found[0][31] == sp + 32


def test_without_translation_settings_only_plain_addresses_pass() -> None:
    assert AARCH64.translated({}) is AARCH64
    assert AARCH64.return_address(0xFFFF_A735_938D_5AC4) == 0xFFFF_A735_938D_5AC4
    assert AARCH64.return_address(0x40_1000) == 0x40_1000
    assert AARCH64.return_address(0xAFE5_A735_938D_5AC4) is None
    assert AARCH64.return_address(0x002A_0000_0040_1000) is None
    assert AARCH64.return_address(1 << 64) is None


def test_kernel_half_and_no_cpu_trap_frame() -> None:
    assert AARCH64.kernel_boundary == AARCH64.shared_from == 0xFF80_0000_0000_0000
    assert AARCH64.trap_frame_sp(0xFFFF_8000_0000_1000, lambda _: 0) is None
    # Words x86 would take for a trap frame (pc, cs, flags, sp all 2): a return is through
    # registers here.
    assert AARCH64.trap_return(0xFFFF_8000_0000_1000, lambda _: 2) is None


def insn(word: int) -> bytes:
    return word.to_bytes(4, "little")


def test_call_before_a_return_address() -> None:
    ra = 0xFFFF_8000_0801_0008
    assert AARCH64.call_before(insn(0x9400_0010), ra) == ra - 4 + 0x40  # bl +0x40
    assert AARCH64.call_before(insn(0x97FF_FFFF), ra) == ra - 8  # bl -4
    assert AARCH64.call_before(insn(0xD63F_0020), ra) is None  # blr x1: no target known
    assert AARCH64.call_before(b"\x00\x00", ra) is None
    assert AARCH64.is_call_before(insn(0x9400_0010), ra)
    assert AARCH64.is_call_before(insn(0xD63F_0020), ra)  # blr x1: a call, target unknown
    assert not AARCH64.is_call_before(insn(0xD61F_0200), ra)  # br x16: a jump
    assert not AARCH64.is_call_before(b"\x00\x00", ra)


def test_jumps_decoded_calls_and_returns_not() -> None:
    code = b"".join(
        insn(word)
        for word in (
            0x1400_0004,  # b +0x10
            0x5400_0041,  # b.ne +0x8
            0xB400_0020,  # cbz x0, +0x4
            0x3600_0060,  # tbz w0, #0, +0xc
            0xD61F_0200,  # br x16
            0x9400_0001,  # bl: a call
            0xD65F_03C0,  # ret
            0xD503_201F,  # nop
        )
    )
    assert AARCH64.branches(code, 0x1000) == [
        (0x1004, 0x1010),
        (0x1008, 0x100C),
        (0x100C, 0x100C),
        (0x1010, 0x1018),
        (0x1014, None),
    ]


KTEXT = 0xFFFF_A735_9380_0000
KSTACK = 0xFFFF_8000_0800_4000


def kregs(pc: int, sp: int, fp: int) -> Registers:
    gprs = {AARCH64.pc: pc, AARCH64.sp: sp, AARCH64.fp: fp}
    return aarch64_registers(0, gprs, 0x3C5)  # EL1h


def test_frame_records_walked_with_codes_stripped() -> None:
    # Three records up the stack, each [caller's x29, signed return address] (the code keeps
    # bit 55, the half it signs for); the outermost's
    # x29 is 0 (Linux's final record of a task).
    a48 = AARCH64.translated({"TCR_EL1": TCR_48})
    fp1, fp2, fp3 = KSTACK + 0x20, KSTACK + 0x60, KSTACK + 0xA0
    mem = memory(
        {
            fp1: fp2, fp1 + 8: 0x12B4_A735_9380_1004,
            fp2: fp3, fp2 + 8: 0x00FF_A735_9380_2008,
            fp3: 0, fp3 + 8: 0xFFFF_A735_9380_300C,
        }
    )  # fmt: skip
    raw = Unwinder(a48).unwind(kregs(KTEXT + 0x10, KSTACK, fp1), mem, AddressSpace([]))
    assert raw.pcs == (KTEXT + 0x10, KTEXT + 0x1004, KTEXT + 0x2008, KTEXT + 0x300C)
    assert raw.via == (Via.REGS, *[Via.FRAME_POINTER] * 3)
    assert raw.stop is StopReason.END


def test_a_signed_return_address_without_translation_settings_stops_the_walk() -> None:
    mem = memory({KSTACK + 0x20: 0, KSTACK + 0x28: 0x12B4_A735_9380_1004})
    raw = Unwinder(AARCH64).unwind(kregs(KTEXT, KSTACK, KSTACK + 0x20), mem, AddressSpace([]))
    assert raw.pcs == (KTEXT,)
    assert raw.stop is StopReason.BAD_RETURN


def test_the_linear_map_ends_below_the_modules_vmalloc_and_image() -> None:
    # PAGE_END: 0xffff800000000000 for 48-bit and 52-bit kernels alike (VA_BITS_MIN 48), where
    # bookworm's 6.12 puts its modules and vmalloc'd task stacks (0xffff800080028000 seen).
    end = AARCH64_LINUX.linear_map_end
    assert end(AARCH64) is None  # TCR_EL1 not known
    assert end(AARCH64.translated({"TCR_EL1": TCR_48})) == 0xFFFF_8000_0000_0000
    assert end(AARCH64.translated({"TCR_EL1": 12 | 12 << 16})) == 0xFFFF_8000_0000_0000
    assert end(AARCH64.translated({"TCR_EL1": 25 | 25 << 16})) == 0xFFFF_FFC0_0000_0000


def test_a_user_image_is_walked_with_the_guests_translation_settings() -> None:
    # Issue 35: a user program's module took its ELF's instruction set, which knows no TCR_EL1:
    # its signed return addresses were kept, and the walk went on into [stack] and [heap].
    a48 = AARCH64.translated({"TCR_EL1": TCR_48})
    image = SimpleNamespace(
        name="xz", path="/usr/bin/xz", build_id=None, load_offset=0, load_range=(0, 0x1_0000),
        arch=AARCH64, cfi=None, text_bytes=b"", text_addr=0, symbols=None, lines=None,
        entry=None,
    )  # fmt: skip
    bias, fp = 0xAAAA_C000_0000, 0xFFFF_E2A0_1000
    module = Module.from_image(cast(ElfImage, image), kernel=False, bias=bias, arch=a48)
    mem = memory({fp: 0, fp + 8: 0x0010_AAAA_C000_2004})  # signed: a PAC in bits 54..48
    regs = aarch64_registers(0, {AARCH64.pc: bias + 0x1000, AARCH64.sp: fp, AARCH64.fp: fp}, 0)
    raw = Unwinder(a48).unwind(regs, mem, AddressSpace([module]))
    assert raw.pcs == (bias + 0x1000, bias + 0x2004)
    assert raw.stop is StopReason.END
    # An image of another instruction set keeps its own.
    other = SimpleNamespace(**{**vars(image), "arch": arch.by_name("x86_64")})
    kept = Module.from_image(cast(ElfImage, other), kernel=False, bias=bias, arch=a48)
    assert all(getattr(step, "arch", None) is not a48 for step in kept.steps)


def test_a_leaf_whose_cfi_keeps_the_return_address_in_x30_has_its_caller() -> None:
    # A leaf function's row (CFA = sp, x30 not saved): its caller's stack pointer is its own,
    # which was taken for a loop: pacspin's leaf (fixtures/aarch64-guest) ended 142 of 156
    # samples so. A caller's frame whose row says the same is still one.
    leaf = Rule(0, 1 << 48, 31, 0, None, (), 30, False)
    bias, sp, ra = 0xAAAA_C000_0000, 0xFFFF_E2A0_1000, 0xAAAA_C000_2004
    mapping = Mapping("prog", bias, bias + 0x1_0000, False, bias)
    module = Module(mapping, (CfiStep(cast(CfiTable, OneRow(leaf)), bias, AARCH64),))
    regs = aarch64_registers(
        0, {AARCH64.pc: bias + 0x1000, AARCH64.sp: sp, AARCH64.fp: 0, 30: ra}, 0
    )
    raw = Unwinder(AARCH64).unwind(regs, memory({}), AddressSpace([module]))
    assert raw.pcs == (bias + 0x1000, ra)
    assert raw.via == (Via.REGS, Via.CFI) and raw.stop is StopReason.LOOP
