"""ORC tables and the ORC step over hand-built tables and stacks: both entry layouts, lookup,
every entry type, every sp and bp rule, crossings into user mode, and a walk by the chain."""

from __future__ import annotations

import struct

import pytest
from fakes import x86

from qmpprof.arch.x86 import X86_64
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.linux.x86_64.orcstep import OrcCode, OrcStep
from qmpprof.linux.x86_64.orctables import (
    CLASSIC,
    RENUMBERED,
    OrcLayout,
    OrcTable,
    OrcType,
    decode_entry,
    detect_layout,
    kernel_version,
)
from qmpprof.model import Mapping, StopReason
from qmpprof.pagecache import PAGE, PageCache, PageMissing, page_of
from qmpprof.unwind.chain import AddressSpace, Module, Unwinder, Via
from qmpprof.unwind.steps import NEW_STACK, FramePointerStep

RAX, RDX, RCX, RBX, RSI, RDI, RBP, RSP = range(8)
R8, R9, R10, R11, R12, R13, R14, R15, RIP = range(8, 17)
TEXT = 0xFFFF_FFFF_8100_0000
KSTACK = 0xFFFF_C900_0001_0000
USTACK = 0x7FFF_F000_0000
SP, BP, UNDEF, PREV_SP = CLASSIC.sp, CLASSIC.bp, CLASSIC.undefined, CLASSIC.prev_sp
CALL, REGS, PARTIAL = OrcType.CALL, OrcType.REGS, OrcType.REGS_PARTIAL
assert CLASSIC.sp_indirect is not None and CLASSIC.bp_indirect is not None
SP_INDIRECT, BP_INDIRECT = CLASSIC.sp_indirect, CLASSIC.bp_indirect


def bits(sp_reg: int, bp_reg: int, kind: int, signal: bool = False) -> int:
    """The u16 bitfield in the 6.4 layout: sp_reg:4 bp_reg:4 type:3 signal:1."""
    return sp_reg | bp_reg << 4 | kind << 8 | signal << 11


def legacy_bits(sp_reg: int, bp_reg: int, kind: int, end: bool = False) -> int:
    """The u16 bitfield before 6.4: sp_reg:4 bp_reg:4 type:2 (0 call, 1 regs, 2 partial) end:1."""
    return sp_reg | bp_reg << 4 | kind << 8 | end << 10


def table_bytes(rows: list[tuple[int, int, int, int]], ip_addr: int) -> tuple[bytes, bytes]:
    """(.orc_unwind_ip, .orc_unwind) for rows of (ip, sp_offset, bp_offset, bitfield)."""
    ips = b"".join(struct.pack("<i", ip - (ip_addr + 4 * i)) for i, (ip, *_) in enumerate(rows))
    entries = b"".join(struct.pack("<hhH", sp, bp, f) for _, sp, bp, f in rows)
    return ips, entries


def table(
    rows: list[tuple[int, int, int, int]], layout: OrcLayout | None = OrcLayout.SIGNAL
) -> OrcTable:
    """A table at TEXT; ``layout`` None: detected from the entries."""
    ip_addr = TEXT + 0x200_0000
    ips, entries = table_bytes(rows, ip_addr)
    return OrcTable.from_sections(ips, ip_addr, entries, layout)


def memory(words: dict[int, int]) -> PageCache:
    """A page cache holding ``words`` (8-byte values); the rest of their pages read as 0."""
    cache = PageCache()
    pages: dict[int, bytearray] = {}
    for addr, value in words.items():
        page = pages.setdefault(page_of(addr), bytearray(PAGE))
        struct.pack_into("<Q", page, addr - page_of(addr), value)
    cache.pages.update((base, bytes(page)) for base, page in pages.items())
    return cache


def pt_regs(addr: int, ip: int, sp: int, cs: int, **gprs: int) -> dict[int, int]:
    """Stack words of a struct pt_regs at ``addr``; ``gprs`` by pt_regs field name."""
    names = ("r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10")
    names += ("r9", "r8", "ax", "cx", "dx", "si", "di", "orig_ax")
    words = {addr + 8 * i: gprs.get(name, 0x1000 + i) for i, name in enumerate(names)}
    words.update({addr + 128: ip, addr + 136: cs, addr + 144: 0x246, addr + 152: sp})
    words[addr + 160] = 0x2B if cs & 3 else 0x18
    return words


def orc_step(
    t: OrcTable,
    bias: int = 0,
    functions: SymbolTable | None = None,
    thunks: tuple[int, int] | None = None,
) -> OrcStep:
    return OrcStep(OrcCode(t, functions, thunks), bias, X86_64)


def step(t: OrcTable, cur: dict[int, int], words: dict[int, int], pc: int = TEXT + 0x10):
    return orc_step(t).step(cur, pc, True, memory(words))


# --- entries and layouts ------------------------------------------------------------------


def test_decode_both_layouts() -> None:
    new = decode_entry(8, -16, bits(SP, PREV_SP, CALL), OrcLayout.SIGNAL)
    assert (new.sp_offset, new.bp_offset, new.sp_reg, new.bp_reg) == (8, -16, SP, PREV_SP)
    assert new.type is CALL and not new.signal
    assert decode_entry(0, 0, bits(SP, UNDEF, REGS, True), OrcLayout.SIGNAL).signal
    assert decode_entry(0, 0, bits(UNDEF, UNDEF, 1), OrcLayout.SIGNAL).type is OrcType.END_OF_STACK
    old = decode_entry(8, 0, legacy_bits(SP, UNDEF, 0), OrcLayout.LEGACY)
    assert old.type is CALL and not old.signal
    for raw, kind in ((1, REGS), (2, PARTIAL)):
        entry = decode_entry(0, 0, legacy_bits(SP, UNDEF, raw), OrcLayout.LEGACY)
        assert entry.type is kind and entry.signal  # legacy kernels: regs frames are exact
    end = decode_entry(0, 0, legacy_bits(UNDEF, UNDEF, 0, end=True), OrcLayout.LEGACY)
    assert end.type is OrcType.END_OF_STACK and not end.signal
    assert decode_entry(0, 0, 0, OrcLayout.LEGACY).type is OrcType.UNDEFINED
    with pytest.raises(ValueError):
        decode_entry(0, 0, legacy_bits(SP, UNDEF, 3), OrcLayout.LEGACY)
    with pytest.raises(ValueError):
        decode_entry(0, 0, bits(SP, UNDEF, 5), OrcLayout.SIGNAL)


def test_detect_layout_from_entries_then_version() -> None:
    call_new = struct.pack("<hhH", 8, 0, bits(SP, UNDEF, CALL))
    call_old = struct.pack("<hhH", 8, 0, legacy_bits(SP, UNDEF, 0))
    undefined = struct.pack("<hhH", 0, 0, 0)
    assert detect_layout(call_new * 5 + undefined) is OrcLayout.SIGNAL
    assert detect_layout(call_old * 5 + undefined, (6, 12)) is OrcLayout.LEGACY  # data first
    signal = struct.pack("<hhH", 0, 0, bits(SP, UNDEF, REGS, True))
    assert detect_layout(signal + call_old * 3) is OrcLayout.SIGNAL  # only 6.4+ sets bit 11
    assert detect_layout(b"", (6, 1)) is OrcLayout.LEGACY
    assert detect_layout(b"", (6, 4)) is OrcLayout.SIGNAL
    assert detect_layout(b"") is OrcLayout.SIGNAL
    banner = b"\0Linux version 6.12.117+deb12-amd64 (debian-kernel@lists.debian.org)"
    assert kernel_version(banner) == (6, 12)
    assert kernel_version(b"no banner") is None


def test_lookup_takes_the_last_entry_at_or_below() -> None:
    t = table(
        [
            (TEXT, 8, 0, bits(SP, UNDEF, CALL)),
            (TEXT + 0x10, 16, 0, bits(SP, UNDEF, CALL)),
            (TEXT + 0x20, 0, 0, 0),  # a weak section terminator, sorted before the real one
            (TEXT + 0x20, 24, 0, bits(SP, UNDEF, CALL)),
            (TEXT + 0x40, 0, 0, 0),  # the end of the text
        ]
    )
    assert len(t) == 5 and t.ip(1) == TEXT + 0x10
    assert t.lookup(TEXT - 1) is None
    assert [t.lookup(TEXT + off).sp_offset for off in (0, 0xF, 0x10, 0x1F)] == [8, 8, 16, 16]
    assert t.lookup(TEXT + 0x25).sp_offset == 24  # the rightmost duplicate, as the kernel
    assert t.lookup(TEXT + 0x40).type is OrcType.UNDEFINED
    assert t.lookup(TEXT + 0x41) is None  # past the last entry


def test_an_unsorted_table_is_sorted() -> None:
    t = table([(TEXT + 0x10, 16, 0, bits(SP, UNDEF, CALL)), (TEXT, 8, 0, bits(SP, UNDEF, CALL))])
    assert [t.ip(0), t.ip(1)] == [TEXT, TEXT + 0x10]
    assert t.lookup(TEXT + 4).sp_offset == 8 and t.lookup(TEXT + 0x10).sp_offset == 16


# --- the step -------------------------------------------------------------------------------


def one(entry_bits: int, sp_offset: int = 8, bp_offset: int = 0) -> OrcTable:
    """A table whose entry at TEXT covers TEXT..TEXT+0xFF."""
    return table([(TEXT, sp_offset, bp_offset, entry_bits), (TEXT + 0x100, 0, 0, 0)])


def test_call_with_sp_base() -> None:
    sp, ra = KSTACK + 0x100, TEXT + 0x5555
    t = one(bits(SP, UNDEF, CALL), sp_offset=24)
    new, signal = step(t, {RIP: TEXT + 0x10, RSP: sp, RBP: 0x77, RBX: 1}, {sp + 16: ra})
    assert new == {RIP: ra, RSP: sp + 24, RBP: 0x77} and not signal  # rbx is not known above


def test_call_with_bp_base_and_bp_saved_below_prev_sp() -> None:
    bp, ra = KSTACK + 0x200, TEXT + 0x4444
    t = one(bits(BP, PREV_SP, CALL), sp_offset=16, bp_offset=-16)
    words = {bp: KSTACK + 0x300, bp + 8: ra}
    new, _ = step(t, {RIP: TEXT, RSP: KSTACK + 0x100, RBP: bp}, words)
    assert new == {RIP: ra, RSP: bp + 16, RBP: KSTACK + 0x300}


def test_bp_rule_relative_to_bp() -> None:
    sp, bp = KSTACK + 0x100, KSTACK + 0x180
    t = one(bits(SP, BP, CALL), sp_offset=8, bp_offset=8)
    new, _ = step(t, {RSP: sp, RBP: bp}, {sp: TEXT + 0x99, bp + 8: 0x1234})
    assert new[RBP] == 0x1234


def test_sp_indirect_and_bp_indirect() -> None:
    sp, other = KSTACK + 0x100, KSTACK + 0x800
    t = one(bits(SP_INDIRECT, UNDEF, CALL), sp_offset=8)  # *sp + 8: off an IRQ stack
    new, flags = step(t, {RSP: sp, RBP: 0}, {sp: other, other: TEXT + 0x11})
    assert new[RSP] == other + 8 and new[RIP] == TEXT + 0x11
    assert flags == NEW_STACK  # a return address (not exact), on another stack
    bp = KSTACK + 0x40
    t = one(bits(BP_INDIRECT, UNDEF, CALL), sp_offset=-8)  # *(bp - 8)
    new, flags = step(t, {RSP: sp, RBP: bp}, {bp - 8: other, other - 8: TEXT + 0x22})
    assert new[RSP] == other and new[RIP] == TEXT + 0x22 and flags == 0


@pytest.mark.parametrize(("reg", "dwarf"), [(6, R10), (7, R13), (3, RDI), (2, RDX)])
def test_register_bases(reg: int, dwarf: int) -> None:  # the classic numbers of R10 .. DX
    base = KSTACK + 0x300
    t = one(bits(reg, UNDEF, PARTIAL, True), sp_offset=0)
    words = {base: TEXT + 0x66, base + 8: 0x10, base + 24: KSTACK + 0x900}
    new, signal = step(t, {RSP: KSTACK, RBP: 0, dwarf: base}, words)
    assert new[RIP] == TEXT + 0x66 and new[RSP] == KSTACK + 0x900 and signal
    # Above a CALL frame that register is unknown: the kernel gives up too.
    assert step(t, {RSP: KSTACK, RBP: 0}, words) is StopReason.NO_CFI


def test_regs_in_kernel_hands_over_every_register() -> None:
    sp = KSTACK + 0x100
    words = pt_regs(sp, TEXT + 0x77, KSTACK + 0x400, 0x10, bp=KSTACK + 0x480, ax=5, r10=6)
    new, signal = step(one(bits(SP, UNDEF, REGS, True), sp_offset=0), {RSP: sp, RBP: 1}, words)
    assert signal
    assert new[RIP] == TEXT + 0x77 and new[RSP] == KSTACK + 0x400 and new[RBP] == KSTACK + 0x480
    assert new[RAX] == 5 and new[R10] == 6 and new[R15] == 0x1000 and new[RDI] == 0x100E


def test_regs_into_user_mode_is_exact_whatever_the_entry_says() -> None:
    sp = KSTACK + 0x3F58
    words = pt_regs(sp, 0x401234, USTACK, 0x33, bp=USTACK + 0x40, bx=9)
    new, signal = step(one(bits(SP, UNDEF, REGS), sp_offset=0), {RSP: sp, RBP: 0}, words)
    assert signal and new[RIP] == 0x401234 and new[RSP] == USTACK and new[RBX] == 9


def test_regs_partial_takes_the_iret_frame_and_keeps_the_rest() -> None:
    sp = KSTACK + 0x100
    words = {sp: TEXT + 0x88, sp + 8: 0x10, sp + 16: 0x246, sp + 24: KSTACK + 0x500, sp + 32: 0}
    cur = {RSP: sp, RBP: 3, RBX: 4}
    new, signal = step(one(bits(SP, UNDEF, PARTIAL, True), sp_offset=0), cur, words)
    assert new == {RIP: TEXT + 0x88, RSP: KSTACK + 0x500, RBP: 3, RBX: 4} and signal
    words[sp + 8] = 0x33  # from user mode: exact even without the entry's signal bit
    _, signal = step(one(bits(SP, UNDEF, PARTIAL), sp_offset=0), cur, words)
    assert signal


def test_legacy_tables_give_the_same_answers() -> None:
    sp = KSTACK + 0x100
    t = table([(TEXT, 8, 0, legacy_bits(SP, UNDEF, 0)), (TEXT + 0x100, 0, 0, 0)], None)
    assert t.layout is OrcLayout.LEGACY
    new, signal = step(t, {RSP: sp, RBP: 0}, {sp: TEXT + 0x99})
    assert new[RIP] == TEXT + 0x99 and not signal
    t = table([(TEXT, 0, 0, legacy_bits(SP, UNDEF, 1)), (TEXT + 0x100, 0, 0, 0)], OrcLayout.LEGACY)
    words = pt_regs(sp, TEXT + 0x42, KSTACK + 0x400, 0x10)
    assert step(t, {RSP: sp, RBP: 0}, words)[1] is True
    end = table([(TEXT, 0, 0, legacy_bits(UNDEF, UNDEF, 0, end=True))], OrcLayout.LEGACY)
    assert step(end, {RSP: sp}, {}, pc=TEXT) is StopReason.END


def test_outcomes_that_end_or_pass() -> None:
    cur = {RSP: KSTACK, RBP: 0}
    assert step(one(bits(UNDEF, UNDEF, OrcType.END_OF_STACK)), cur, {}) is StopReason.END
    assert step(one(0), cur, {}) is StopReason.NO_CFI  # UNDEFINED: the kernel gives up here
    assert step(one(bits(SP, 12, CALL)), cur, {KSTACK: 1}) is StopReason.NO_CFI  # bad bp_reg
    assert step(one(bits(14, UNDEF, CALL)), cur, {}) is StopReason.NO_CFI  # bad sp_reg
    assert step(one(bits(SP, UNDEF, 6)), cur, {}) is StopReason.NO_CFI  # bad type
    assert step(one(bits(SP, UNDEF, CALL)), cur, {}, pc=TEXT - 1) is None  # no entry
    assert step(one(bits(SP, UNDEF, CALL)), cur, {}, pc=TEXT + 0x200) is None  # past the end
    unmapped = PageCache()
    unmapped.pages[page_of(KSTACK)] = None
    assert orc_step(one(bits(SP, UNDEF, CALL))).step(cur, TEXT, True, unmapped) == (
        StopReason.READ_FAILED
    )
    with pytest.raises(PageMissing):
        orc_step(one(bits(SP, UNDEF, CALL))).step(cur, TEXT, True, PageCache())


def test_undefined_code_is_walked_only_from_a_functions_first_byte() -> None:
    """A return thunk (ORC: UNDEFINED) entered by a call: on its first byte the return
    address is at RSP, as gdb finds it; inside it, or as a caller's frame, still no CFI."""
    sp, ra, slide = KSTACK + 0x100, TEXT + 0x5555, 0x200_0000
    thunk = SymbolTable([Symbol(TEXT + 0x40, 0x20, "srso_return_thunk")])
    orc = orc_step(one(0), bias=slide, functions=thunk)
    cur, words = {RSP: sp, RBP: 0x77}, memory({sp: ra})
    out = orc.step(cur, TEXT + slide + 0x40, True, words)
    assert out == ({RIP: ra, RSP: sp + 8, RBP: 0x77}, False)
    assert orc.step(cur, TEXT + slide + 0x46, True, words) is StopReason.NO_CFI
    assert orc.step(cur, TEXT + slide + 0x40, False, words) is StopReason.NO_CFI
    assert orc_step(one(0), bias=slide).step(cur, TEXT + slide + 0x40, True, words) is (
        StopReason.NO_CFI
    )


def test_legacy_thunks_read_as_an_end_are_walked_from_their_first_byte() -> None:
    """Before 6.4 a thunk's hint (UNWIND_HINT_EMPTY) is "undefined, end": it decodes as
    END_OF_STACK like entry_SYSCALL_64's. Within the thunks' range, on a function's first
    byte, the return address is at RSP; elsewhere the end stays an end (inside a retpoline
    thunk too, see test_a_walk_through_a_retpoline_thunk_equals_gdbs)."""
    sp, ra, slide = KSTACK + 0x100, TEXT + 0x5555, 0x200_0000
    end = legacy_bits(UNDEF, UNDEF, 0, end=True)
    t = table([(TEXT, 0, 0, end), (TEXT + 0x100, 0, 0, 0)], OrcLayout.LEGACY)
    functions = SymbolTable(
        [
            Symbol(TEXT + 0x20, 0x10, "entry_SYSCALL_64"),
            Symbol(TEXT + 0x40, 0x20, "__x86_indirect_thunk_rax"),
            Symbol(TEXT + 0x60, 0x20, "__x86_return_thunk"),
        ]
    )
    orc = orc_step(t, bias=slide, functions=functions, thunks=(TEXT + 0x40, TEXT + 0x80))
    cur, words = {RSP: sp, RBP: 0x77}, memory({sp: ra})
    for thunk in (TEXT + 0x40, TEXT + 0x60):
        assert orc.step(cur, thunk + slide, True, words) == ({RIP: ra, RSP: sp + 8, RBP: 0x77}, 0)
    assert orc.step(cur, TEXT + slide + 0x66, True, words) is StopReason.END
    assert orc.step(cur, TEXT + slide + 0x60, False, words) is StopReason.END
    assert orc.step(cur, TEXT + slide + 0x20, True, words) is StopReason.END  # a true end
    no_range = orc_step(t, bias=slide, functions=functions)
    assert no_range.step(cur, TEXT + slide + 0x40, True, words) is StopReason.END


# A retpoline thunk as 6.12 lays it out at TEXT + 0x40 (objtool's entries as in its vmlinux):
#   +0  e8 01 00 00 00   call +6         UNDEFINED (UNWIND_HINT_UNDEFINED)
#   +5  cc               int3            (never runs: the speculation trap)
#   +6  48 89 04 24      mov %rax,(%rsp)
#   +10 e9 ...           jmp __x86_return_thunk     CALL, sp + 8 (UNWIND_HINT_FUNC)
#   +15 nops up to the next thunk                   UNDEFINED
THUNK = TEXT + 0x40
THUNK_ROWS = [
    (TEXT, 8, 0, bits(SP, UNDEF, CALL)),
    (THUNK, 0, 0, 0),
    (THUNK + 10, 8, 0, bits(SP, UNDEF, CALL)),
    (THUNK + 15, 0, 0, 0),
    (THUNK + 0x20, 8, 0, bits(SP, UNDEF, CALL)),
    (TEXT + 0x100, 0, 0, 0),
]


@pytest.mark.parametrize("name", ["__x86_indirect_thunk_array", "__pi___x86_indirect_thunk_rax"])
def test_a_retpoline_thunk_is_walked_after_its_internal_call(name: str) -> None:
    """Stopped at the thunk's ``mov`` (issue 19: a TCG block start after the internal call):
    RSP holds the internal call's return address (thunk + 5), then the caller's. The frame
    at thunk + 5 (looked up at + 4, in that call) is back at the thunk's entry. gdb walks
    both (``__x86_indirect_thunk_array+6``, ``+4``, then the caller); ORC says UNDEFINED.
    From 6.16 kallsyms names the thunk by its startup-code alias (``__pi_``; booted
    7.2.13+deb14-rt-amd64: a sample there stopped as NO_CFI)."""
    sp, ra = KSTACK + 0x100, TEXT + 0x5555
    functions = SymbolTable([Symbol(THUNK, 0x20, name)])
    orc = orc_step(table(THUNK_ROWS), functions=functions)
    words = memory({sp: THUNK + 5, sp + 8: ra})
    inner = orc.step({RSP: sp, RBP: 0x77}, THUNK + 6, True, words)
    assert inner == ({RIP: THUNK + 5, RSP: sp + 8, RBP: 0x77}, False)
    outer = orc.step({RSP: sp + 8, RBP: 0x77}, THUNK + 4, False, words)
    assert outer == ({RIP: ra, RSP: sp + 16, RBP: 0x77}, False)
    # Without names the thunk is unknown code, as before.
    assert orc_step(table(THUNK_ROWS)).step({RSP: sp}, THUNK + 6, True, words) is (
        StopReason.NO_CFI
    )


def test_a_walk_through_a_retpoline_thunk_equals_gdbs() -> None:
    """Stopped in the thunk called by a function: thunk + 6, thunk + 5, the caller's return
    address, and the caller's caller by its CALL entry, before 6.4 (the thunk's hint read as an
    end, within the thunks' range) as from 6.4 on."""
    sp = KSTACK + 0x3E00
    words = memory({sp: THUNK + 5, sp + 8: TEXT + 0x15, sp + 16: TEXT + 0x205})
    functions = SymbolTable([Symbol(THUNK, 0x20, "__x86_indirect_thunk_array")])
    legacy_end = legacy_bits(UNDEF, UNDEF, 0, end=True)
    legacy = [
        (ip, sp_off, bp, legacy_bits(SP, UNDEF, 0) if f else legacy_end)
        for ip, sp_off, bp, f in THUNK_ROWS
    ]
    for t, thunks in (
        (table(THUNK_ROWS), None),
        (table(legacy, OrcLayout.LEGACY), (THUNK, THUNK + 0x20)),
    ):
        step = orc_step(t, functions=functions, thunks=thunks)
        kernel = Module(
            Mapping("vmlinux", TEXT, TEXT + 0x300, True), (step, FramePointerStep(X86_64))
        )
        regs = x86(0, THUNK + 6, sp)
        raw = Unwinder(X86_64).unwind(regs, words, AddressSpace([kernel]))
        assert raw.pcs[:4] == (THUNK + 6, THUNK + 5, TEXT + 0x15, TEXT + 0x205), t.layout
        assert raw.exact[:3] == (True, False, False)


def test_bias_moves_the_table() -> None:
    slide = 0x2A0_0000
    sp = KSTACK + 0x100
    out = orc_step(one(bits(SP, UNDEF, CALL)), bias=slide).step(
        {RSP: sp, RBP: 0}, TEXT + slide + 0x10, False, memory({sp: TEXT + slide + 0x99})
    )
    assert isinstance(out, tuple) and out[0][RIP] == TEXT + slide + 0x99


# --- a walk -------------------------------------------------------------------------------


def test_walk_from_a_kernel_function_through_a_syscall_into_user_code() -> None:
    """leaf (CALL, sp+16) -> caller (CALL, sp+8) -> entry code (REGS) -> user frame pointers."""
    t = table(
        [
            (TEXT, 16, 0, bits(SP, UNDEF, CALL)),  # leaf: one push
            (TEXT + 0x100, 8, 0, bits(SP, UNDEF, CALL)),  # its caller
            (TEXT + 0x200, 0, 0, bits(SP, UNDEF, REGS, True)),  # entry_SYSCALL_64 after push
            (TEXT + 0x300, 0, 0, 0),
        ]
    )
    kernel = Module(
        Mapping("vmlinux", TEXT, TEXT + 0x300, True), (orc_step(t), FramePointerStep(X86_64))
    )
    space = AddressSpace([kernel])
    sp = KSTACK + 0x3E00
    regs_at = sp + 16 + 8
    words = {sp + 8: TEXT + 0x105, sp + 16: TEXT + 0x205}
    ubp = USTACK + 0x100
    words |= pt_regs(regs_at, 0x401000, USTACK, 0x33, bp=ubp)
    words |= {ubp: 0, ubp + 8: 0x402000}
    rsp_regs = x86(0, TEXT + 0x20, sp)
    raw = Unwinder(X86_64).unwind(rsp_regs, memory(words), space)
    assert raw.pcs == (TEXT + 0x20, TEXT + 0x105, TEXT + 0x205, 0x401000, 0x402000)
    assert raw.exact == (True, False, False, True, False)
    assert raw.via == (Via.REGS, Via.ORC, Via.ORC, Via.ORC, Via.FRAME_POINTER)
    assert raw.stop is StopReason.END


def test_walk_off_an_irq_stack_onto_a_lower_task_stack() -> None:
    """An interrupt handler on the IRQ stack -> the function that switched to it (SP_INDIRECT:
    the task's stack pointer saved at the IRQ stack's top) -> its caller on the task stack,
    which lies below the IRQ stack (Debian's 6.1: the idle task's and early kernel threads'
    stacks): the stack pointer goes down, and that is no loop."""
    t = table(
        [
            (TEXT, 8, 0, bits(SP, UNDEF, CALL)),  # the handler on the IRQ stack
            (TEXT + 0x100, 8, 0, bits(SP_INDIRECT, UNDEF, CALL)),  # after call_on_stack
            (TEXT + 0x200, 8, 0, bits(SP, UNDEF, CALL)),  # its caller, on the task stack
            (TEXT + 0x300, 0, 0, bits(UNDEF, UNDEF, OrcType.END_OF_STACK)),
            (TEXT + 0x400, 0, 0, 0),
        ]
    )
    kernel = Module(
        Mapping("vmlinux", TEXT, TEXT + 0x400, True), (orc_step(t), FramePointerStep(X86_64))
    )
    irq_sp = KSTACK + 0x3F00
    task_sp = KSTACK - 0x10_0000 + 0x3E00  # another stack, 1 MiB lower
    words = {irq_sp: TEXT + 0x105, irq_sp + 8: task_sp}  # return address, saved task sp
    words |= {task_sp: TEXT + 0x205, task_sp + 8: TEXT + 0x305}
    regs = x86(0, TEXT + 0x20, irq_sp)
    raw = Unwinder(X86_64).unwind(regs, memory(words), AddressSpace([kernel]))
    assert raw.pcs == (TEXT + 0x20, TEXT + 0x105, TEXT + 0x205, TEXT + 0x305)
    assert raw.exact == (True, False, False, False)
    assert raw.stop is StopReason.END


def test_walk_off_a_5_10_irq_stack_by_bp_onto_a_lower_task_stack() -> None:
    """5.10's asm_call_irq_on_stack: ``push %rbp; mov %rsp, %rbp; mov %rdi, %rsp; call``, so
    after the call the caller's frame is bp + 16 (the task's stack pointer kept in bp). Seen on
    Debian's 5.10.0-46-cloud-amd64 (scripts/check-kernels, booted): swapper/1's stack lies
    below its IRQ stack, and the walk stopped there as a loop (5 of 497 kernel stacks)."""
    t = table(
        [
            (TEXT, 8, 0, bits(SP, UNDEF, CALL)),  # the handler on the IRQ stack
            (TEXT + 0x100, 16, -16, bits(BP, PREV_SP, CALL)),  # after the switch: bp + 16
            (TEXT + 0x200, 8, 0, bits(SP, UNDEF, CALL)),  # its caller, on the task stack
            (TEXT + 0x300, 0, 0, bits(UNDEF, UNDEF, OrcType.END_OF_STACK)),
            (TEXT + 0x400, 0, 0, 0),
        ]
    )
    kernel = Module(
        Mapping("vmlinux", TEXT, TEXT + 0x400, True), (orc_step(t), FramePointerStep(X86_64))
    )
    irq_sp = KSTACK + 0x3F00
    task_bp = KSTACK - 0x10_0000 + 0x3E00  # the task's sp after push %rbp, 1 MiB lower
    words = {irq_sp: TEXT + 0x105}  # the call's return address on the IRQ stack
    words |= {task_bp: 0, task_bp + 8: TEXT + 0x205, task_bp + 16: TEXT + 0x305}
    regs = x86(0, TEXT + 0x20, irq_sp, task_bp)
    raw = Unwinder(X86_64).unwind(regs, memory(words), AddressSpace([kernel]))
    assert raw.pcs == (TEXT + 0x20, TEXT + 0x105, TEXT + 0x205, TEXT + 0x305)
    assert raw.stop is StopReason.END


def test_a_kernel_that_renumbered_its_registers_is_walked_by_its_numbers() -> None:
    """7.x renumbered ORC's registers (SP 3, PREV_SP 8, BP_INDIRECT 10, AX 1): the same frames
    written in its numbers walk the same; read with the classic ones they would not."""
    sp, bp = KSTACK + 0x100, KSTACK + 0x180
    rows = [(TEXT, 16, -16, bits(RENUMBERED.sp, RENUMBERED.prev_sp, CALL)), (TEXT + 0x100, 0, 0, 0)]
    new, _ = step_renumbered(table(rows), {RSP: sp, RBP: 1}, {sp + 8: TEXT + 0x44, sp: bp})
    assert new == {RIP: TEXT + 0x44, RSP: sp + 16, RBP: bp}
    assert step(table(rows), {RSP: sp, RBP: 1}, {sp + 8: TEXT + 0x44, sp: bp}) is StopReason.NO_CFI
    regs_at = KSTACK + 0x300
    partial = table(
        [(TEXT, 0, 0, bits(1, RENUMBERED.undefined, PARTIAL, True)), (TEXT + 0x100, 0, 0, 0)]
    )
    words = {regs_at: TEXT + 0x66, regs_at + 8: 0x10, regs_at + 24: KSTACK + 0x900}
    new, signal = step_renumbered(partial, {RSP: KSTACK, RBP: 0, RAX: regs_at}, words)
    assert new[RIP] == TEXT + 0x66 and signal  # AX, a base 7.x added


def step_renumbered(t: OrcTable, cur: dict[int, int], words: dict[int, int]):
    t.regs = RENUMBERED
    return orc_step(t).step(cur, TEXT + 0x10, True, memory(words))
