"""aarch64 prologue and epilogue analysis (``arch/aarch64code.py``): hand-assembled functions at
each of their instructions, the walk it gives (the caller a frame-record walk skips: a leaf's,
a function's in its prologue or epilogue), and real functions of bookworm's arm64 6.1 and 6.12
Images (their instructions, as capstone reads them, in the comments), also against the CFI of
their debug vmlinux (gcc's own account of every pc)."""

from __future__ import annotations

import random

import pytest
from aarch64vm import SERIES, image
from test_arch_aarch64 import TCR_48, kregs
from test_unwind_chain import memory

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.aarch64code import (
    LR,
    PROLOGUES,
    branch_target,
    is_eret,
    is_jump,
    moved_imm,
    pair_stored_at,
    sets_fp,
    stored_at,
)
from qmpprof.arch.base import PrologueRule
from qmpprof.dwarf.cfi import Kind
from qmpprof.elf.image import ElfImage
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.model import Mapping, StopReason
from qmpprof.unwind.chain import AddressSpace, Unwinder, Via
from qmpprof.unwind.space import Module

NOP, PACIASP, AUTIASP, RET, BL = 0xD503201F, 0xD503233F, 0xD50323BF, 0xD65F03C0, 0x94000010
STP_PRE_32 = 0xA9BE7BFD  # stp x29, x30, [sp, #-32]!
MOV_FP = 0x910003FD  # mov x29, sp
LDP_POST_32 = 0xA8C27BFD  # ldp x29, x30, [sp], #32
SUB_SP_80 = 0xD10143FF  # sub sp, sp, #0x50
STP_48 = 0xA9037BFD  # stp x29, x30, [sp, #48]
ADD_FP_48 = 0x9100C3FD  # add x29, sp, #48
LDP_48 = 0xA9437BFD  # ldp x29, x30, [sp, #48]
ADD_SP_80 = 0x910143FF  # add sp, sp, #0x50
LDR_X19 = 0xF9400BF3  # ldr x19, [sp, #16]
CBZ = 0xB4000040  # cbz x0, +8

BASE = 0xFFFF_8000_0801_0000


def code(*words: int) -> bytes:
    return b"".join(w.to_bytes(4, "little") for w in words)


# f: nop; nop; paciasp; stp x29, x30, [sp, #-32]!; mov x29, sp; bl; ldr x19; ldp post; autiasp; ret
F = code(NOP, NOP, PACIASP, STP_PRE_32, MOV_FP, BL, LDR_X19, LDP_POST_32, AUTIASP, RET)
# g: paciasp; sub sp, #0x50; stp x29, x30, [sp, #48]; add x29, sp, #48; bl; ldp [sp, #48];
#    add sp, #0x50; autiasp; ret
G = code(PACIASP, SUB_SP_80, STP_48, ADD_FP_48, BL, LDP_48, ADD_SP_80, AUTIASP, RET)
IN_X30 = PrologueRule(0, ra_register=LR)
F_RECORD = PrologueRule(32, fp_offset=-32, ra_offset=-24)
G_RECORD = PrologueRule(80, fp_offset=-32, ra_offset=-24)


@pytest.mark.parametrize(
    ("body", "index", "rule"),
    [
        (F, 0, IN_X30),  # ftrace's nops
        (F, 3, IN_X30),  # at the stp: nothing saved yet
        (F, 4, F_RECORD),  # record stored, x29 not yet at it
        (F, 5, None),  # x29 at the record: frame records are right
        (F, 7, None),  # at the ldp: the record is still live
        (F, 8, IN_X30),  # loaded back and sp up again: x30 holds the return
        (F, 9, IN_X30),
        (G, 1, IN_X30),
        (G, 2, PrologueRule(80, ra_register=LR)),  # frame allocated, nothing stored
        (G, 3, G_RECORD),
        (G, 4, None),
        (G, 6, PrologueRule(80, ra_register=LR)),  # loaded back, sp not yet up
        (G, 7, IN_X30),
    ],
)
def test_prologue_and_epilogue_states(body: bytes, index: int, rule: PrologueRule | None) -> None:
    assert PROLOGUES.analyze(body, BASE, BASE + 4 * index, BASE) == rule


def test_a_leaf_keeps_its_return_address_in_x30() -> None:
    leaf = code(PACIASP, CBZ, NOP, AUTIASP, RET, 0xD2800000, AUTIASP, RET)  # mov x0, #0
    for index in range(len(leaf) // 4):
        assert PROLOGUES.analyze(leaf, BASE, BASE + 4 * index, BASE) == IN_X30


def test_no_function_start_and_no_epilogue_ahead_is_no_answer() -> None:
    assert PROLOGUES.analyze(F, BASE, BASE + 16, None) is None
    assert PROLOGUES.analyze(F, BASE, BASE + 32, None) == IN_X30  # the epilogue needs none
    assert PROLOGUES.analyze(F, BASE, BASE + 2, BASE) is None  # not an instruction boundary
    assert PROLOGUES.analyze(F, BASE, BASE + len(F), BASE) is None  # past the code


ADRP_X16, ADD_X16, BR_X16 = 0x90000010, 0x91004210, 0xD61F0200  # adrp; add x16, x16, #0x10
LDR_X17_X16, ADD_X16_24, BR_X17 = 0xF9400E11, 0x91006210, 0xD61F0220  # ldr x17, [x16, #0x18]
BTI_C = 0xD503245F


@pytest.mark.parametrize(
    "body",
    [
        code(ADRP_X16, ADD_X16, BR_X16),  # Linux's module PLT entry
        code(BTI_C, ADRP_X16, ADD_X16, BR_X16),
        code(ADRP_X16, LDR_X17_X16, ADD_X16_24, BR_X17),  # a glibc PLT entry
        code(0x92800010, 0xF2A00010, 0xF2C00010, BR_X16),  # movn x16; movk x16 x2: Linux 4.x
    ],
    ids=["module-plt", "bti", "glibc-plt", "moves"],
)
def test_a_veneer_no_function_covers_keeps_the_return_address_in_x30(body: bytes) -> None:
    for index in range(len(body) // 4):
        assert PROLOGUES.analyze(body, BASE, BASE + 4 * index, None) == IN_X30


@pytest.mark.parametrize(
    "body",
    [
        code(0x90000000, BR_X16),  # adrp x0: a register a veneer may not change
        code(0x91000410, BR_X16),  # add x16, x0, #1: no veneer reads another register
        code(ADRP_X16, ADD_X16, 0xD61F0020),  # br x1
        code(0xF94003F0, BR_X16),  # ldr x16, [sp]
        code(ADRP_X16, ADD_X16, 0xD63F0200),  # blr x16: a call, not a veneer
        code(ADRP_X16, ADD_X16),  # no jump within the code
    ],
    ids=["adrp-x0", "add-from-x0", "br-x1", "ldr-from-sp", "blr", "no-jump"],
)
def test_other_code_no_function_covers_is_no_answer(body: bytes) -> None:
    assert PROLOGUES.analyze(body, BASE, BASE, None) is None


KSTACK = 0xFFFF_8000_0800_4000
CALLER = BASE + 0x1004  # in another function of the module
OUTER = KSTACK + 0x200  # the caller's record: [0, 0] ends the walk


def walk(pc: int, sp: int, fp: int, x30: int, words: dict[int, int]) -> tuple[int, ...]:
    arch = AARCH64.translated({"TCR_EL1": TCR_48})
    text = F + bytes(0x2000 - len(F))
    module = Module.build(
        Mapping("vmlinux", BASE, BASE + 0x2000, True), arch, code=text, code_addr=BASE,
        symbols=SymbolTable([Symbol(BASE, len(F), "f"), Symbol(BASE + 0x1000, 0x100, "caller")]),
    )  # fmt: skip
    regs = kregs(pc, sp, fp)
    regs.gprs[LR] = x30
    mem = memory(words | {OUTER: 0, OUTER + 8: 0})
    raw = Unwinder(arch).unwind(regs, mem, AddressSpace([module]))
    assert raw.stop is StopReason.END
    return raw.pcs


def test_walk_takes_the_caller_from_x30_where_records_would_skip_it() -> None:
    signed = 0x12B4_0000_0000_0000 | CALLER  # a pointer-authentication code in the top bits
    # At f's first instruction x29 is the caller's: [x29 + 8] would be the caller's caller.
    assert walk(BASE, KSTACK, OUTER, signed, {}) == (BASE, CALLER)
    # After the stp, before mov x29, sp: the record at sp holds the caller's x29 and x30.
    words = {KSTACK - 32: OUTER, KSTACK - 24: signed}
    assert walk(BASE + 16, KSTACK - 32, OUTER, 0, words) == (BASE + 16, CALLER)
    # At autiasp after the ldp: the same as at the start.
    assert walk(BASE + 32, KSTACK, OUTER, signed, {}) == (BASE + 32, CALLER)


def test_walk_from_a_module_s_plt_veneer_takes_its_caller_from_x30() -> None:
    # Caught in a module's PLT (past its functions, on the way out of the module's reach):
    # x29 is the calling function's record, whose x30 slot is that function's caller.
    arch = AARCH64.translated({"TCR_EL1": TCR_48})
    plt = BASE + 0x1800
    text = bytearray(0x2000)
    text[0x1800:0x180C] = code(ADRP_X16, ADD_X16, BR_X16)
    module = Module.build(
        Mapping("[m]", BASE, BASE + 0x2000, True), arch, code=bytes(text), code_addr=BASE,
        symbols=SymbolTable([Symbol(BASE + 0x1000, 0x100, "caller")]),
    )  # fmt: skip
    record = KSTACK + 0x40  # the caller's: its caller's x29, then a return past the module
    regs = kregs(plt, KSTACK, record)
    regs.gprs[LR] = CALLER
    mem = memory({record: OUTER, record + 8: BASE + 0x1F00, OUTER: 0, OUTER + 8: 0})
    raw = Unwinder(arch).unwind(regs, mem, AddressSpace([module]))
    assert raw.pcs[:3] == (plt, CALLER, BASE + 0x1F00)


def test_the_caller_of_a_link_register_frame_may_share_its_stack_pointer() -> None:
    arch = AARCH64.translated({"TCR_EL1": TCR_48})
    module = Module.build(
        Mapping("vmlinux", BASE, BASE + 0x2000, True), arch, code=F + bytes(0x2000 - len(F)),
        code_addr=BASE, symbols=SymbolTable([Symbol(BASE, len(F), "f")]),
    )  # fmt: skip
    regs = kregs(BASE, KSTACK, OUTER)
    regs.gprs[LR] = CALLER
    mem = memory({OUTER: 0, OUTER + 8: 0})
    raw = Unwinder(arch).unwind(regs, mem, AddressSpace([module]))
    assert raw.via == (Via.REGS, Via.PROLOGUE, Via.FRAME_POINTER)[: len(raw.via)]
    assert raw.pcs[:2] == (BASE, CALLER) and raw.stop is StopReason.END


# Functions of the Images and, per offset, what the analysis must answer: "x30" (the return
# address in the link register, sp + the frame), "record" (on the stack at sp), None (x29).
REAL = {
    "6.1": [
        # nop; nop; paciasp; stp x29, x30, [sp, #-32]!; mov x29, sp; ...
        ("bcm2835_handle_irq", {0: "x30", 12: "x30", 16: "record", 20: None, 64: None,
                                68: "x30", 72: "x30"}),
        # nop; nop; paciasp; sub sp, sp, #0x80; mrs; stp x29, x30, [sp, #0x50]; add x29, ...
        ("name_to_dev_t", {12: "x30", 16: "x30", 20: "x30", 24: "record", 28: None}),
        ("arch_local_irq_save", {0: "x30", 12: "x30", 20: "x30"}),  # a leaf
    ],
    # nop; nop; paciasp; stp x29, x30, [sp, #-0x30]!; mov x29, sp; stp x19, x20, ...
    "6.12": [("gic_handle_irq", {0: "x30", 8: "x30", 12: "x30", 16: "record", 20: None})],
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(REAL))
def kernel(request: pytest.FixtureRequest) -> tuple[str, LinuxKernel]:
    return request.param, LinuxKernel.load(image(request.param))


def kind(rule: PrologueRule | None) -> str | None:
    if rule is None:
        return None
    return "x30" if rule.ra_register == LR else "record"


def test_real_functions(kernel: tuple[str, LinuxKernel]) -> None:
    series, linux = kernel
    text, text_addr = linux.image.text_bytes, linux.image.text_addr
    for name, expected in REAL[series]:
        start = linux.symbols.address_of(name)
        assert start is not None, name
        found = {
            off: kind(AARCH64.prologue(text, text_addr, start + off, start)) for off in expected
        }
        assert found == expected, name


CFI_FUNCTIONS = 600  # random functions of each Image, every pc of their first 4 KiB


def test_answers_agree_with_the_compiler_s_cfi(kernel: tuple[str, LinuxKernel]) -> None:
    """Where the debug vmlinux's CFI says the return address is still in x30, the analysis
    must say so with the same frame size; where it reads it from the stack, it must read the
    same slot. Measured (6.1, 6.12): 0 of 4995 and 1 of 4685 pcs in x30 differ, 0 of 642 and
    0 of 660 on the stack. Needs the debug vmlinux (scripts/fetch-linux-dbg, the oracle's)."""
    series, linux = kernel
    cfi = ElfImage.load(SERIES[series] / "vmlinux-dbg", mapped=True).cfi
    assert cfi is not None
    text, text_addr = linux.image.text_bytes, linux.image.text_addr
    checked = wrong = 0
    for start, end, _ in random.Random(22).sample(linux.functions.items(), CFI_FUNCTIONS):
        for pc in range(start, min(end, start + 4096), 4):
            row = cfi.row_for(pc)
            if row is None or row.cfa_expr is not None or row.cfa_reg != 31:
                continue  # x29-based: frame records, the analysis has nothing to add
            lr = row.reg(LR)
            found = AARCH64.prologue(text, text_addr, pc, start)
            if lr is None or lr.kind in (Kind.SAME, Kind.UNDEFINED):
                checked += 1
                wrong += found != PrologueRule(row.cfa_offset, ra_register=LR)
            elif lr.kind is Kind.OFFSET and found is not None and found.ra_register is None:
                checked += 1
                wrong += (found.cfa_offset, found.ra_offset) != (row.cfa_offset, lr.value)
    assert checked > 2000 and wrong <= checked // 100, (checked, wrong)


def test_exception_code_s_instructions_are_decoded() -> None:
    at = 0xFFFF_8000_1001_0A18
    assert branch_target(0x1400042A, at) == at + 0x10A8  # b el1_sync (5.10's vectors + 0x218)
    assert branch_target(0x17FFFFFF, at) == at - 4  # b . - 4: imm26 is signed
    assert branch_target(0x9400042A, at) is None  # bl: a call, not a branch to a handler
    assert sets_fp(0x9104C3FD) == 0x130  # add x29, sp, #0x130
    assert sets_fp(0x9104C3FC) is None  # add x28, sp, #0x130
    # The record a kernel-mode handler stores: 6.12's stp x29, x22, [sp, #0x130], 7.2's stp
    # xzr, xzr, [sp, #0x128]; elsewhere, pre-indexed, or not on sp: not such a store.
    assert pair_stored_at(0xA9135BFD, 0x130) == (29, 22)
    assert pair_stored_at(0xA912FFFF, 0x128) == (31, 31)
    assert pair_stored_at(0xA912FFFF, 0x130) is None
    assert pair_stored_at(0xA9BE7BFD, -32) is None  # stp x29, x30, [sp, #-32]!
    assert pair_stored_at(0xA912FC1F, 0x128) is None  # stp xzr, xzr, [x0, #0x128]
    # 7.2's record kind: mov x0, #2; str x0, [sp, #312] (its word in frame_record_meta); not a
    # 32-bit move or store, another offset or base.
    assert moved_imm(0xD2800040) == (0, 2) and moved_imm(0xD2A00021) == (1, 0x10000)
    assert moved_imm(0x52800040) is None  # mov w0, #2
    assert stored_at(0xF9009FE0, 312) == 0 and stored_at(0xF9009FE0, 0x130) is None
    assert stored_at(0xF9009C20, 312) is None  # str x0, [x1, #312]
    assert stored_at(0xB9013BE0, 312) is None  # str w0, [sp, #312]
    assert is_eret(0xD69F03E0) and not is_eret(0xD65F03C0)  # eret, ret
    jumps = (0x1400042A, 0xD61F03C0, 0xD65F03C0, 0xD69F03E0, 0xD4210000)  # b, br, ret, eret, brk
    assert all(map(is_jump, jumps))
    # bl, blr x1, cbnz x2, nop: what follows is reached
    assert not any(map(is_jump, (0x9400042A, 0xD63F0020, 0xB5000B62, 0xD503201F)))
