"""CfiTable on hand-built .eh_frame / .debug_frame bytes: every DW_CFA opcode gcc emits,
pointer encodings, augmentations, .eh_frame_hdr, DWARF expressions and malformed input."""

from __future__ import annotations

import random
import struct

import pytest

from qmpprof.dwarf.cfi import CfiTable, Kind, RegRule, Rule
from qmpprof.dwarf.expr import evaluate

RSP, RBP, RBX, R12, RIP = 7, 6, 3, 12, 16
SECTION = 0x2000  # address the hand-built section pretends to live at


def uleb(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def sleb(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        done = (value == 0 and not byte & 0x40) or (value == -1 and byte & 0x40)
        out.append(byte | (0 if done else 0x80))
        if done:
            return bytes(out)


# The instructions every x86_64 CIE starts with: CFA = rsp+8, return address at CFA-8.
CIE_INIT = (
    b"\x0c" + uleb(RSP) + uleb(8)  # DW_CFA_def_cfa: rsp, 8
    + bytes([0x80 | RIP]) + uleb(1)  # DW_CFA_offset: rip at CFA + 1*-8
)  # fmt: skip


def cie(init: bytes = CIE_INIT, aug: bytes = b"zR", aug_data: bytes = b"\x00") -> bytes:
    """An .eh_frame CIE; the default FDE pointer encoding is DW_EH_PE_absptr (0x00)."""
    body = (
        struct.pack("<I", 0)  # CIE id: 0 marks a CIE in .eh_frame
        + b"\x01"  # version 1
        + aug + b"\x00"  # augmentation string
        + uleb(1)  # code alignment factor
        + sleb(-8)  # data alignment factor
        + bytes([RIP])  # return address register (a byte in version 1)
        + (uleb(len(aug_data)) + aug_data if aug.startswith(b"z") else b"")  # augmentation data
        + init  # initial instructions
    )  # fmt: skip
    return struct.pack("<I", len(body)) + body  # length


def fde(
    cie_pos: int, pos: int, pc_begin: int, pc_range: int, insns: bytes, fde_aug: bytes = b""
) -> bytes:
    """An .eh_frame FDE at section offset ``pos`` with absptr pc_begin/pc_range."""
    body = (
        struct.pack("<I", pos + 4 - cie_pos)  # CIE pointer: distance back from this field
        + struct.pack("<Q", pc_begin)  # initial location
        + struct.pack("<Q", pc_range)  # address range
        + uleb(len(fde_aug)) + fde_aug  # augmentation data ("z")
        + insns  # call frame instructions
    )  # fmt: skip
    return struct.pack("<I", len(body)) + body  # length


def table(*fdes: tuple[int, int, bytes], init: bytes = CIE_INIT) -> CfiTable:
    """A CIE followed by FDEs (pc_begin, pc_range, instructions) and the zero terminator."""
    data = cie(init)
    for begin, size, insns in fdes:
        data += fde(0, len(data), begin, size, insns)
    return CfiTable.parse(data + b"\x00" * 4, SECTION)


def regs(rule: Rule) -> dict[int, RegRule]:
    return dict(rule.regs)


RA_RULE = RegRule(Kind.OFFSET, -8)


def test_cie_initial_row_applies_to_an_fde_without_instructions() -> None:
    rule = table((0x1000, 0x20, b"")).row_for(0x1010)
    assert rule is not None
    assert (rule.cfa_reg, rule.cfa_offset, rule.cfa_expr) == (RSP, 8, None)
    assert regs(rule) == {RIP: RA_RULE}
    assert (rule.start, rule.end, rule.ra, rule.signal) == (0x1000, 0x1020, RIP, False)


def test_pcs_outside_every_fde_have_no_row() -> None:
    t = table((0x1000, 0x20, b""), (0x1040, 0x10, b""))
    assert t.row_for(0xFFF) is None
    assert t.row_for(0x1020) is None  # the gap between the two functions
    assert t.row_for(0x1050) is None
    assert t.row_for(0x1045) is not None


@pytest.mark.parametrize(
    ("insns", "cfa"),
    [
        (b"\x0c" + uleb(RBP) + uleb(16), (RBP, 16)),  # def_cfa rbp, 16
        (b"\x12" + uleb(RSP) + sleb(-3), (RSP, 24)),  # def_cfa_sf: factored, -3 * -8
        (b"\x0d" + uleb(RBP), (RBP, 8)),  # def_cfa_register rbp (offset kept)
        (b"\x0e" + uleb(48), (RSP, 48)),  # def_cfa_offset 48 (not factored)
        (b"\x13" + sleb(-4), (RSP, 32)),  # def_cfa_offset_sf: -4 * -8
    ],
)
def test_cfa_rules(insns: bytes, cfa: tuple[int, int]) -> None:
    rule = table((0x1000, 0x10, insns)).row_for(0x1000)
    assert rule is not None
    assert (rule.cfa_reg, rule.cfa_offset, rule.cfa_expr) == (*cfa, None)


def test_def_cfa_expression_replaces_the_register_rule() -> None:
    expr = b"\x77\x08"  # DW_OP_breg7 (rsp) +8
    insns = b"\x0f" + uleb(len(expr)) + expr  # DW_CFA_def_cfa_expression
    rule = table((0x1000, 0x10, insns)).row_for(0x1000)
    assert rule is not None and rule.cfa_expr == expr
    insns2 = insns + b"\x0c" + uleb(RSP) + uleb(16)  # a later def_cfa replaces the expression
    rule2 = table((0x1000, 0x10, insns2)).row_for(0x1000)
    assert rule2 is not None and (rule2.cfa_reg, rule2.cfa_offset, rule2.cfa_expr) == (
        RSP,
        16,
        None,
    )


@pytest.mark.parametrize(
    ("insns", "expected"),
    [
        (bytes([0x80 | RBX]) + uleb(2), RegRule(Kind.OFFSET, -16)),  # offset rbx, 2*-8
        (b"\x05" + uleb(RBX) + uleb(3), RegRule(Kind.OFFSET, -24)),  # offset_extended
        (b"\x11" + uleb(RBX) + sleb(-2), RegRule(Kind.OFFSET, 16)),  # offset_extended_sf
        (b"\x2f" + uleb(RBX) + uleb(2), RegRule(Kind.OFFSET, 16)),  # GNU_negative_offset_ext
        (b"\x14" + uleb(RBX) + uleb(2), RegRule(Kind.VAL_OFFSET, -16)),  # val_offset
        (b"\x15" + uleb(RBX) + sleb(1), RegRule(Kind.VAL_OFFSET, -8)),  # val_offset_sf
        (b"\x07" + uleb(RBX), RegRule(Kind.UNDEFINED)),  # undefined
        (b"\x08" + uleb(RBX), RegRule(Kind.SAME)),  # same_value
        (b"\x09" + uleb(RBX) + uleb(R12), RegRule(Kind.REGISTER, R12)),  # register rbx in r12
        (b"\x10" + uleb(RBX) + b"\x02\x77\x10", RegRule(Kind.EXPRESSION, 0, b"\x77\x10")),
        (b"\x16" + uleb(RBX) + b"\x02\x77\x10", RegRule(Kind.VAL_EXPRESSION, 0, b"\x77\x10")),
    ],
)
def test_register_rules(insns: bytes, expected: RegRule) -> None:
    rule = table((0x1000, 0x10, insns)).row_for(0x1000)
    assert rule is not None
    assert regs(rule) == {RBX: expected, RIP: RA_RULE}


def test_advance_opcodes_start_new_rows() -> None:
    insns = (
        bytes([0x40 | 4])  # advance_loc 4 -> 0x1004
        + b"\x0e" + uleb(16)  # def_cfa_offset 16
        + b"\x02\x10"  # advance_loc1 0x10 -> 0x1014
        + b"\x0e" + uleb(24)  # def_cfa_offset 24
        + b"\x03" + struct.pack("<H", 0x100)  # advance_loc2 0x100 -> 0x1114
        + b"\x0e" + uleb(32)  # def_cfa_offset 32
        + b"\x04" + struct.pack("<I", 0x1000)  # advance_loc4 0x1000 -> 0x2114
        + b"\x0e" + uleb(40)  # def_cfa_offset 40
        + b"\x01" + struct.pack("<Q", 0x3000)  # set_loc 0x3000 (absptr)
        + b"\x0e" + uleb(48)  # def_cfa_offset 48
    )  # fmt: skip
    t = table((0x1000, 0x4000, insns))
    expected = [(0x1000, 8), (0x1004, 16), (0x1014, 24), (0x1114, 32), (0x2114, 40), (0x3000, 48)]
    for pc, offset in expected:
        for probe in (pc, pc + 3):
            rule = t.row_for(probe)
            assert rule is not None and rule.cfa_offset == offset, hex(probe)
    assert [(r.start, r.end) for r in t.rows(t.fdes()[0])][-1] == (0x3000, 0x5000)


def test_restore_returns_to_the_cie_rule_or_to_none() -> None:
    insns = (
        bytes([0x80 | RIP]) + uleb(3)  # offset rip, -24 (overrides the CIE rule)
        + bytes([0x80 | RBX]) + uleb(2)  # offset rbx, -16
        + bytes([0x40 | 1])  # advance_loc 1
        + bytes([0xC0 | RIP])  # restore rip: back to the CIE's c-8
        + b"\x06" + uleb(RBX)  # restore_extended rbx: the CIE has no rule -> dropped
    )  # fmt: skip
    t = table((0x1000, 0x10, insns))
    first, second = t.row_for(0x1000), t.row_for(0x1001)
    assert first is not None and second is not None
    assert regs(first) == {RBX: RegRule(Kind.OFFSET, -16), RIP: RegRule(Kind.OFFSET, -24)}
    assert regs(second) == {RIP: RA_RULE}


def test_remember_and_restore_state_include_the_cfa() -> None:
    insns = (
        b"\x0e" + uleb(16)  # def_cfa_offset 16
        + bytes([0x80 | RBX]) + uleb(2)  # offset rbx, -16
        + b"\x0a"  # remember_state
        + bytes([0x40 | 2])  # advance_loc 2
        + b"\x0e" + uleb(8)  # def_cfa_offset 8 (epilogue)
        + bytes([0xC0 | RBX])  # restore rbx
        + bytes([0x40 | 1])  # advance_loc 1
        + b"\x0b"  # restore_state
    )  # fmt: skip
    t = table((0x1000, 0x10, insns))
    mid, after = t.row_for(0x1002), t.row_for(0x1003)
    assert mid is not None and after is not None
    assert (mid.cfa_offset, RBX in regs(mid)) == (8, False)
    assert (after.cfa_offset, regs(after)[RBX]) == (16, RegRule(Kind.OFFSET, -16))


def test_gnu_args_size_nop_and_window_save_are_skipped() -> None:
    # Regression: pyelftools 0.33 raises ValueError on DW_CFA_GNU_args_size (0x2e).
    insns = (
        b"\x2e" + uleb(16)  # GNU_args_size 16
        + b"\x00"  # nop
        + b"\x2d"  # GNU_window_save
        + b"\x0e" + uleb(32)  # def_cfa_offset 32
    )  # fmt: skip
    rule = table((0x1000, 0x10, insns)).row_for(0x1008)
    assert rule is not None and rule.cfa_offset == 32


def test_signal_frame_augmentation_and_personality() -> None:
    aug_data = (
        b"\x9b" + struct.pack("<i", 0x100)  # P: indirect|pcrel|sdata4 personality pointer
        + b"\x1b"  # L: LSDA encoding pcrel|sdata4
        + b"\x00"  # R: FDE encoding absptr
    )  # fmt: skip
    data = cie(aug=b"zPLRS", aug_data=aug_data)
    data += fde(0, len(data), 0x1000, 0x10, b"", fde_aug=struct.pack("<i", 0x40))  # LSDA
    rule = CfiTable.parse(data, SECTION).row_for(0x1004)
    assert rule is not None and rule.signal and regs(rule) == {RIP: RA_RULE}


def test_pcrel_sdata4_pointers() -> None:
    data = cie(aug_data=b"\x1b")  # R: pcrel|sdata4, what gcc emits
    pos = len(data)
    field_addr = SECTION + pos + 8  # the pc_begin field follows length and CIE pointer
    body = (
        struct.pack("<I", pos + 4)  # CIE pointer back to offset 0
        + struct.pack("<i", 0x1000 - field_addr)  # pc_begin, relative to its own address
        + struct.pack("<i", 0x30)  # pc_range (no relative adjustment)
        + uleb(0)  # augmentation data length
    )  # fmt: skip
    data += struct.pack("<I", len(body)) + body
    t = CfiTable.parse(data, SECTION)
    assert [(f.pc_begin, f.pc_end) for f in t.fdes()] == [(0x1000, 0x1030)]
    assert t.row_for(0x102F) is not None and t.row_for(0x1030) is None


def eh_frame_hdr(entries: list[tuple[int, int]], hdr_addr: int) -> bytes:
    """.eh_frame_hdr listing (initial location, FDE address) pairs, datarel|sdata4."""
    out = (
        b"\x01"  # version
        + b"\x1b"  # eh_frame_ptr encoding: pcrel|sdata4
        + b"\x03"  # fde_count encoding: udata4
        + b"\x3b"  # table encoding: datarel|sdata4
        + struct.pack("<i", SECTION - (hdr_addr + 4))  # eh_frame_ptr
        + struct.pack("<I", len(entries))  # fde_count
    )  # fmt: skip
    for loc, addr in entries:
        out += struct.pack("<ii", loc - hdr_addr, addr - hdr_addr)
    return out


def test_eh_frame_hdr_table_is_what_lookups_use() -> None:
    data = cie()
    first = len(data)
    data += fde(0, first, 0x1000, 0x10, b"")
    data += fde(0, len(data), 0x2000, 0x10, b"")
    hdr_addr = 0x1800
    only_first = eh_frame_hdr([(0x1000, SECTION + first)], hdr_addr)
    t = CfiTable.parse(data, SECTION, hdr=only_first, hdr_addr=hdr_addr)
    assert t.row_for(0x1000) is not None
    assert t.row_for(0x2000) is None  # not in the table: proves the table was used
    bogus = eh_frame_hdr([(0x1000, SECTION + 0x9999)], hdr_addr)  # FDE outside the section
    t2 = CfiTable.parse(data, SECTION, hdr=bogus, hdr_addr=hdr_addr)
    assert t2.row_for(0x2000) is not None  # fell back to scanning the records


def test_debug_frame_with_32_and_64_bit_records() -> None:
    cie_body = (
        struct.pack("<I", 0xFFFFFFFF)  # CIE id in .debug_frame
        + b"\x03"  # version 3
        + b"\x00"  # augmentation ""
        + uleb(1) + sleb(-8)  # code / data alignment
        + uleb(RIP)  # return address register (uleb in version 3)
        + CIE_INIT
    )  # fmt: skip
    data = struct.pack("<I", len(cie_body)) + cie_body
    fde_body = (
        struct.pack("<I", 0)  # CIE pointer: section offset of the CIE
        + struct.pack("<QQ", 0x1000, 0x10)  # initial location, range
        + b"\x0e" + uleb(16)  # def_cfa_offset 16
    )  # fmt: skip
    data += struct.pack("<I", len(fde_body)) + fde_body
    wide_body = (
        struct.pack("<Q", 0)  # 64-bit CIE pointer
        + struct.pack("<QQ", 0x2000, 0x10)  # initial location, range
        + b"\x0e" + uleb(24)  # def_cfa_offset 24
    )  # fmt: skip
    data += struct.pack("<IQ", 0xFFFFFFFF, len(wide_body)) + wide_body  # 64-bit DWARF length
    t = CfiTable.parse(data, 0, kind="debug_frame")
    first, second = t.row_for(0x1004), t.row_for(0x2004)
    assert first is not None and first.cfa_offset == 16 and regs(first) == {RIP: RA_RULE}
    assert second is not None and second.cfa_offset == 24


def test_debug_frame_with_4_byte_addresses() -> None:
    """i386: a version-4 CIE says address_size 4; the FDE's location, range and set_loc are 4
    bytes each."""
    esp, eip = 4, 8
    cie_body = (
        struct.pack("<I", 0xFFFFFFFF)  # CIE id in .debug_frame
        + b"\x04"  # version 4
        + b"\x00"  # augmentation ""
        + b"\x04"  # address_size
        + b"\x00"  # segment_selector_size
        + uleb(1) + sleb(-4)  # code / data alignment
        + uleb(eip)  # return address register
        + b"\x0c" + uleb(esp) + uleb(4)  # def_cfa esp, 4
        + bytes([0x80 | eip]) + uleb(1)  # offset: eip at CFA + 1*-4
    )  # fmt: skip
    data = struct.pack("<I", len(cie_body)) + cie_body
    fde_body = (
        struct.pack("<I", 0)  # CIE pointer: section offset of the CIE
        + struct.pack("<II", 0xC0001000, 0x10)  # initial location, range: 4 bytes each
        + b"\x0e" + uleb(8)  # def_cfa_offset 8
        + b"\x01" + struct.pack("<I", 0xC0001008)  # set_loc: a 4-byte absolute address
        + b"\x0e" + uleb(12)  # def_cfa_offset 12
    )  # fmt: skip
    data += struct.pack("<I", len(fde_body)) + fde_body
    t = CfiTable.parse(data, 0, kind="debug_frame", address_size=4)
    first, second = t.row_for(0xC0001004), t.row_for(0xC000100A)
    assert first is not None and (first.cfa_reg, first.cfa_offset, first.ra) == (esp, 8, eip)
    assert regs(first) == {eip: RegRule(Kind.OFFSET, -4)}
    assert second is not None and second.cfa_offset == 12
    assert t.row_for(0xC0001010) is None
    # The same bytes read as x86_64: the CIE's address_size 4 does not match, nothing decodes.
    assert CfiTable.parse(data, 0, kind="debug_frame").row_for(0xC0001004) is None


def test_unknown_opcode_keeps_the_rows_before_it() -> None:
    insns = b"\x0e" + uleb(16) + bytes([0x40 | 4]) + b"\x3f"  # 0x3f: not a DW_CFA opcode
    t = table((0x1000, 0x10, insns))
    rule = t.row_for(0x1002)
    assert rule is not None and rule.cfa_offset == 16
    assert t.row_for(0x1004) is None


RESTORE_WITHOUT_REMEMBER = cie() + fde(0, len(cie()), 0x1000, 0x10, b"\x0b")


@pytest.mark.parametrize(
    "data",
    [
        cie()[:10],  # truncated CIE
        struct.pack("<I", 0x1000) + cie()[4:],  # length runs past the section
        cie(aug_data=b"\x07") + fde(0, len(cie(aug_data=b"\x07")), 0x1000, 0x10, b""),  # bad enc
        cie(aug=b"xyz") + fde(0, len(cie(aug=b"xyz")), 0x1000, 0x10, b""),  # unknown augmentation
        RESTORE_WITHOUT_REMEMBER,
        RESTORE_WITHOUT_REMEMBER[:-3],  # FDE cut in the middle
        b"",
    ],
)
def test_malformed_input_gives_no_row(data: bytes) -> None:
    t = CfiTable.parse(data, SECTION)
    assert t.row_for(0x1004) is None


def test_random_garbage_never_raises() -> None:
    rng = random.Random(4)
    good = cie() + fde(0, len(cie()), 0x1000, 0x100, b"\x0e\x10\x44\x0e\x18")
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        t = CfiTable.parse(bytes(data), SECTION)
        for pc in (0x1000, 0x1004, 0x10FF):
            rule = t.row_for(pc)
            assert rule is None or rule.start <= pc < rule.end


# --- DWARF expressions -------------------------------------------------------------------

PLT_EXPR = (
    b"\x77\x08"  # DW_OP_breg7 (rsp) + 8
    b"\x80\x00"  # DW_OP_breg16 (rip) + 0
    b"\x3f"  # DW_OP_lit15
    b"\x1a"  # DW_OP_and
    b"\x3b"  # DW_OP_lit11
    b"\x2a"  # DW_OP_ge
    b"\x33"  # DW_OP_lit3
    b"\x24"  # DW_OP_shl
    b"\x22"  # DW_OP_plus
)


def no_memory(addr: int) -> int | None:
    return None


@pytest.mark.parametrize(("rip", "cfa"), [(0x401024, 0x7000 + 8), (0x40102C, 0x7000 + 16)])
def test_plt_cfa_expression(rip: int, cfa: int) -> None:
    # The .plt's CFA: rsp+8, or rsp+16 once the stub has pushed its relocation index.
    assert evaluate(PLT_EXPR, {RSP: 0x7000, RIP: rip}, no_memory) == cfa


# The i386 guest's trap-frame esp rule (fixtures/guest/kernel/entry32.S), the CFA pushed first:
# [CFA] when the saved cs (at CFA-8) has RPL 3, the CFA itself otherwise.
I386_TRAP_ESP = bytes.fromhex("12 38 1c 94 04 33 1a 28 03 00 2f 02 00 94 04")


@pytest.mark.parametrize(("cs", "esp"), [(0x23, 0x7FFFC0), (0x08, 0xC0140F00)])
def test_i386_expression_uses_4_byte_words(cs: int, esp: int) -> None:
    cfa = 0xC0140F00
    words = {cfa - 8: cs, cfa: 0x7FFFC0, cfa + 4: 0xFFFFFFFF}

    def read(addr: int) -> int:
        return words.get(addr, 0) | words.get(addr + 4, 0) << 32

    assert evaluate(I386_TRAP_ESP, {}, read, push=cfa, address_size=4) == esp
    # DW_OP_deref reads an address-sized word; arithmetic wraps at 32 bits.
    assert evaluate(b"\x06", {}, read, push=cfa, address_size=4) == 0x7FFFC0
    assert evaluate(b"\x06", {}, read, push=cfa) == 0xFFFFFFFF007FFFC0
    assert evaluate(b"\x74" + sleb(-8), {4: 4}, read, address_size=4) == 0xFFFFFFFC
    assert evaluate(b"\x03" + struct.pack("<I", 0xC0001000), {}, read, address_size=4) == (
        0xC0001000
    )


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        (b"\x08\xff", 0xFF),  # const1u
        (b"\x09\xff", (1 << 64) - 1),  # const1s -1
        (b"\x0a\x34\x12", 0x1234),  # const2u
        (b"\x0d\xfe\xff\xff\xff", (1 << 64) - 2),  # const4s -2
        (b"\x0e" + struct.pack("<Q", 1 << 40), 1 << 40),  # const8u
        (b"\x10" + uleb(300), 300),  # constu
        (b"\x11" + sleb(-5) + b"\x1f", 5),  # consts -5, neg
        (b"\x35\x33\x1c", 2),  # lit5 lit3 minus
        (b"\x3c\x33\x21", 15),  # lit12 lit3 or
        (b"\x40\x32\x25", 4),  # lit16 lit2 shr
        (b"\x35\x33\x2b", 1),  # lit5 lit3 gt
        (b"\x35\x33\x2d", 0),  # lit5 lit3 lt
        (b"\x31\x32\x33\x15\x02", 1),  # pick 2
        (b"\x31\x32\x16\x1c", 1),  # swap, minus
        (b"\x31\x32\x33\x17\x1c\x1c", 4),  # lit1 lit2 lit3 rot -> 3 1 2; minus minus
        (b"\x31\x28\x02\x00\x34\x96\x35", 5),  # bra over lit4 (taken), nop, lit5
        (b"\x2f\x01\x00\x34\x35", 5),  # skip lit4
        (b"\x56", 0x7000),  # reg6 (rbp)
        (b"\x92\x07" + sleb(-8), 0x7000 - 8),  # bregx rsp -8
        (b"\x77\x00\x06", 0x1234_DEAD),  # breg7 deref
        (b"\x77\x00\x94\x02", 0xDEAD),  # deref_size 2 (low bytes)
        (b"\x31\x2e\x00", None),  # ne with one operand: malformed
        (b"\xe0", None),  # DW_OP_lo_user: unknown
        (b"\x51", None),  # reg1: a register we have no value for
        (b"\x30\x06", None),  # deref of an unreadable address
        (b"\x2f\x00\x80", None),  # skip out of the expression
    ],
)
def test_expression_operations(expr: bytes, value: int | None) -> None:
    regs = {RSP: 0x7000, RBP: 0x7000}

    def read(addr: int) -> int | None:
        return 0x1234_DEAD if addr == 0x7000 else None

    assert evaluate(expr, regs, read) == value, expr.hex()
