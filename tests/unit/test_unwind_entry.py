"""The walk through a kernel's exception code (``unwind/entry.py``) over hand-made stacks: a
sample entered from user mode is one whole frame, or goes on in user code from the exception
link register and the user stack pointer before anything was saved (in the function a user-mode
handler calls: its frame, the handler's, then user code), one at a kernel-mode vector
entry continues at the exception link register, a handler's frame record leads into the saved
registers (the interrupted pc exact, then analysed as the interrupted frame); and arm64 Linux's
description read from its code (``linux/aarch64/vectors.py``): bookworm's 6.1 and 6.12 Images (what
their handlers' names say), bullseye's 5.10 from its real words (handlers that ``eret``
themselves), changed code giving none; and the Linux guest reading the exception link register
(and the user stack pointer) for the samples that need it, only those."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import pytest
from aarch64vm import image
from test_arch_aarch64 import TCR_48, kregs
from test_arch_aarch64code import BASE, F
from test_unwind_chain import memory

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.aarch64code import LR
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.linux.aarch64.vectors import (
    ELR,
    SP_EL0,
    Code,
    entry_code,
    entry_shapes,
    exception_code,
)
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.identify import LinuxIdentifier
from qmpprof.model import Mapping, StopReason
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.chain import AddressSpace, RawStack, Unwinder, Via
from qmpprof.unwind.entry import EntryCode, SavedFrame
from qmpprof.unwind.space import Module

PT_REGS = SavedFrame(regs=0, count=31, sp=248, pc=256, status=264, record=304, size=336)
VECTORS = BASE + 0x800
HANDLER = BASE + 0x1100  # an el1h_64_irq
RET_TO_KERNEL = BASE + 0x1200
CALLER = BASE + 0x1804  # after a call, in another function
ENTRY = EntryCode(
    user=((VECTORS + 0x400, VECTORS + 0x800), (BASE + 0x1300, BASE + 0x1400)),
    vectors=(VECTORS + 0x200, VECTORS + 0x400),
    entries=tuple(range(VECTORS + 0x200, VECTORS + 0x400, 0x80)),
    saving=((HANDLER, HANDLER + 0x68),),
    restoring=((RET_TO_KERNEL, RET_TO_KERNEL + 0x64),),
    frame=PT_REGS,
    link=ELR,
    # The 64-bit user entries but their second instruction, a user handler's first one.
    unsaved=(
        (VECTORS + 0x400, VECTORS + 0x404),
        (VECTORS + 0x408, VECTORS + 0x480),
        (VECTORS + 0x480, VECTORS + 0x484),
        (VECTORS + 0x488, VECTORS + 0x500),
        (BASE + 0x1300, BASE + 0x1304),
    ),
    user_sp=SP_EL0,
    link_name="ELR_EL1",
    user_sp_name="SP_EL0",
)
USER_PC, USER_SP, USER_FP = 0x40_1000, 0x7FFF_F000, 0x7FFF_F010
KSTACK = 0xFFFF_8000_0800_8000
OUTER = KSTACK + 0x800  # the outermost record: [0, 0]
ARCH = AARCH64.translated({"TCR_EL1": TCR_48})


def space(slide: int = 0, entry: EntryCode = ENTRY) -> AddressSpace:
    text = F + bytes(0x2000 - len(F))
    symbols = SymbolTable(
        [Symbol(BASE, len(F), "f"), Symbol(HANDLER, 0x68, "el1h_64_irq"),
         Symbol(BASE + 0x1800, 0x100, "caller")]
    )  # fmt: skip
    module = Module.build(
        Mapping("vmlinux", BASE + slide, BASE + slide + 0x2000, True, slide), ARCH, code=text,
        code_addr=BASE, symbols=symbols, entry=entry,
    )  # fmt: skip
    return AddressSpace([module])


def walk(
    pc: int, sp: int, fp: int, words: dict[int, int], entry: EntryCode = ENTRY, **gprs: int
) -> RawStack:
    regs = kregs(pc, sp, fp)
    numbers = {"elr": ELR, "sp_el0": SP_EL0, "x30": LR}
    regs.gprs.update({numbers[name]: value for name, value in gprs.items()})
    words |= {OUTER: 0, OUTER + 8: 0}
    return Unwinder(ARCH).unwind(regs, memory(words), space(entry=entry))


@pytest.mark.parametrize("pc", [VECTORS + 0x480, VECTORS + 0x600, BASE + 0x1300, BASE + 0x13FC])
def test_entered_from_user_mode_the_kernel_stack_is_one_frame(pc: int) -> None:
    raw = walk(pc, KSTACK, 0x7FFF_F000, {})  # x29: the user's
    assert raw.pcs == (pc,) and raw.stop is StopReason.END


@pytest.mark.parametrize("pc", [VECTORS + 0x480, VECTORS + 0x408, BASE + 0x1300])
def test_entered_from_user_mode_before_anything_is_saved_the_walk_goes_on_in_user_code(
    pc: int,
) -> None:
    # The user's x29 (its record: the outermost) and x30 are the CPU's, its pc in ELR_EL1, its
    # stack pointer in SP_EL0.
    words = {USER_FP: 0, USER_FP + 8: 0}
    raw = walk(pc, KSTACK, USER_FP, words, elr=USER_PC, sp_el0=USER_SP, x30=0x40_2000)
    assert raw.pcs == (pc, USER_PC) and raw.exact == (True, True)
    assert raw.via == (Via.REGS, Via.ENTRY) and raw.stop is StopReason.END


@pytest.mark.parametrize("pc", [VECTORS + 0x484, VECTORS + 0x680, BASE + 0x1304])
def test_entered_from_user_mode_where_the_cpu_holds_not_the_user_s_it_is_one_frame(
    pc: int,
) -> None:
    # A trampoline's return in x30 (an entry's second instruction), 32-bit user code, a
    # handler past its first instruction (kernel_entry clears the registers it saved).
    words = {USER_FP: 0, USER_FP + 8: 0}
    raw = walk(pc, KSTACK, USER_FP, words, elr=USER_PC, sp_el0=USER_SP)
    assert raw.pcs == (pc,) and raw.stop is StopReason.END


def test_a_vector_entry_from_the_kernel_continues_at_the_exception_link_register() -> None:
    # Interrupted at f's first instruction (a leaf so far): its caller is in x30.
    raw = walk(VECTORS + 0x280, KSTACK, OUTER, {}, elr=BASE, x30=CALLER)
    assert raw.pcs == (VECTORS + 0x280, BASE, CALLER)
    assert raw.exact[:2] == (True, True) and raw.via[1:] == (Via.ENTRY, Via.PROLOGUE)
    assert raw.stop is StopReason.END


def test_a_vector_entry_without_the_link_register_is_truncated() -> None:
    raw = walk(VECTORS + 0x280, KSTACK, OUTER, {}, x30=CALLER)
    assert raw.pcs == (VECTORS + 0x280,) and raw.stop is StopReason.NO_CFI
    # Past the entry's first instruction sp is being adjusted: not modelled either.
    raw = walk(VECTORS + 0x284, KSTACK, OUTER, {}, elr=BASE, x30=CALLER)
    assert raw.pcs == (VECTORS + 0x284,) and raw.stop is StopReason.NO_CFI


def pt_regs(
    base: int, pc: int, sp: int, fp: int, lr: int, status: int = 0x3C5, frame: SavedFrame = PT_REGS
) -> dict[int, int]:
    """A saved frame at ``base``: x29, x30, sp, pc, pstate, and its record {x29, pc}."""
    record = base + frame.record
    return {
        base + 29 * 8: fp, base + 30 * 8: lr, base + frame.sp: sp, base + frame.pc: pc,
        base + frame.status: status, record: fp, record + 8: pc,
    }  # fmt: skip


def test_a_handler_s_record_leads_into_the_saved_registers() -> None:
    # The handler called a function (its record at KSTACK + 0x10) that called the leaf we are
    # in; the handler's own record is inside pt_regs at KSTACK + 0x40. The interrupted code
    # was f after its stp (the record at its sp, x29 not yet set): prologue analysis reads it.
    frame = KSTACK + 0x40
    f_sp = frame + PT_REGS.size + 0x40
    words = pt_regs(frame, BASE + 16, f_sp, OUTER, 0)
    words |= {f_sp: OUTER, f_sp + 8: CALLER}  # f's record, stored by its stp
    words |= {KSTACK + 0x10: frame + PT_REGS.record, KSTACK + 0x18: HANDLER + 0x64}
    raw = walk(BASE + 0x1000, KSTACK, KSTACK + 0x10, words, x30=BASE + 0x1000)
    assert raw.pcs == (BASE + 0x1000, HANDLER + 0x64, BASE + 16, CALLER)
    assert raw.exact == (True, False, True, False)
    assert raw.via == (Via.REGS, Via.FRAME_POINTER, Via.ENTRY, Via.PROLOGUE)
    assert raw.stop is StopReason.END


def test_a_handler_s_zeroed_record_leads_into_the_saved_registers() -> None:
    # From 6.13 the kernel-mode handlers zero their record (EntryCode.linked False): pt_regs is
    # found from the record's address, as above.
    frame = KSTACK + 0x40
    f_sp = frame + PT_REGS.size + 0x40
    record = frame + PT_REGS.record
    words = pt_regs(frame, BASE + 16, f_sp, OUTER, 0) | {record: 0, record + 8: 0}
    words |= {f_sp: OUTER, f_sp + 8: CALLER}
    words |= {KSTACK + 0x10: record, KSTACK + 0x18: HANDLER + 0x64}
    zeroed = replace(ENTRY, linked=False)
    raw = walk(BASE + 0x1000, KSTACK, KSTACK + 0x10, words, zeroed, x30=BASE + 0x1000)
    assert raw.pcs == (BASE + 0x1000, HANDLER + 0x64, BASE + 16, CALLER)
    assert raw.via == (Via.REGS, Via.FRAME_POINTER, Via.ENTRY, Via.PROLOGUE)
    # Read as a record holding the pc (6.12's model), the zeroed one is the stack's end: the
    # stop at el1h_64_* of issue 35; a record not zeroed is no saved frame for 6.13's model.
    raw = walk(BASE + 0x1000, KSTACK, KSTACK + 0x10, words, x30=BASE + 0x1000)
    assert raw.pcs == (BASE + 0x1000, HANDLER + 0x64) and raw.stop is StopReason.END
    words |= {record: OUTER, record + 8: BASE + 16}
    raw = walk(BASE + 0x1000, KSTACK, KSTACK + 0x10, words, zeroed, x30=BASE + 0x1000)
    assert raw.pcs[:3] == (BASE + 0x1000, HANDLER + 0x64, BASE + 16)
    assert raw.via[2] is Via.FRAME_POINTER


# 7.2's pt_regs (its BTF) and handlers (objdump of its Image): the record zeroed at +0x128, its
# kind word (FRAME_META_TYPE_PT_REGS, 2) at +0x138, x29 set at el1h_64_*+0x5c, the pc and status
# stored at +0x60; an el0t_64_* handler (here the user span at BASE + 0x1300) the same.
PT_REGS_7 = SavedFrame(regs=0, count=31, sp=248, pc=256, status=264, record=296, size=320, kind=312)
USER_HANDLER_PC_UNSAVED = BASE + 0x1384
ENTRY_7 = replace(
    ENTRY, frame=PT_REGS_7, linked=False, record_kind=2,
    pc_unsaved=((HANDLER + 0x60, HANDLER + 0x64), (BASE + 0x1384, BASE + 0x1388)),
)  # fmt: skip


def zeroed(base: int, frame: SavedFrame = PT_REGS_7, kind: int = 2) -> dict[int, int]:
    """A 6.13+ record in the saved frame at ``base``: zeros, then its kind word."""
    assert frame.kind is not None
    return {base + frame.record: 0, base + frame.record + 8: 0, base + frame.kind: kind}


def test_a_7x_handler_s_frame_leads_into_its_saved_registers() -> None:
    # el1h_64_irq's call into its handler, which called the leaf we are in: the record inside
    # pt_regs is zeroed and only its address leads to pt_regs (7.2's layout).
    frame = KSTACK + 0x40
    f_sp = frame + PT_REGS_7.size + 0x40
    record = frame + PT_REGS_7.record
    words = pt_regs(frame, BASE + 16, f_sp, OUTER, 0, frame=PT_REGS_7) | zeroed(frame)
    words |= {f_sp: OUTER, f_sp + 8: CALLER}  # f's record, stored by its stp
    words |= {KSTACK + 0x10: record, KSTACK + 0x18: HANDLER + 0x64}
    raw = walk(BASE + 0x1000, KSTACK, KSTACK + 0x10, words, ENTRY_7, x30=BASE + 0x1000)
    assert raw.pcs == (BASE + 0x1000, HANDLER + 0x64, BASE + 16, CALLER)
    assert raw.via == (Via.REGS, Via.FRAME_POINTER, Via.ENTRY, Via.PROLOGUE)
    assert raw.exact[2] and raw.stop is StopReason.END
    # A zeroed record of another kind (FINAL, 1: a user entry's) is no saved frame of the
    # kernel's: the record, zeros, is then the stack's end, as for the kernel's own unwinder.
    raw = walk(BASE + 0x1000, KSTACK, KSTACK + 0x10, words | zeroed(frame, kind=1), ENTRY_7)
    assert raw.pcs == (BASE + 0x1000, HANDLER + 0x64) and raw.stop is StopReason.END


def test_between_a_handler_s_record_and_its_pc_store_the_pc_is_the_link_register_s() -> None:
    # Interrupted at el1h_64_irq+0x60: x29 at the zeroed record, pt_regs whole but its pc and
    # pstate (still last use's: a stale pc from user mode here). The pc is ELR_EL1's.
    words = pt_regs(KSTACK, 0x40_1000, KSTACK + 0x400, OUTER, CALLER, 0, PT_REGS_7)
    words |= zeroed(KSTACK)
    fp = KSTACK + PT_REGS_7.record
    assert ENTRY_7.holds_link(HANDLER + 0x60)
    raw = walk(HANDLER + 0x60, KSTACK, fp, words, ENTRY_7, elr=BASE)
    assert raw.pcs == (HANDLER + 0x60, BASE, CALLER) and raw.via[1] is Via.ENTRY
    assert raw.exact[:2] == (True, True)
    raw = walk(HANDLER + 0x60, KSTACK, fp, words, ENTRY_7)  # ELR_EL1 not read
    assert raw.pcs == (HANDLER + 0x60,) and raw.stop is StopReason.NO_CFI
    # Once the pc is stored (+0x64) it is read from pt_regs: from user mode here, the end.
    raw = walk(HANDLER + 0x64, KSTACK, fp, words, ENTRY_7, elr=BASE)
    assert raw.pcs == (HANDLER + 0x64,) and raw.stop is StopReason.END


def test_between_a_user_handler_s_record_and_its_pc_store_the_user_pc_is_the_link_register_s(
) -> None:  # fmt: skip
    words = pt_regs(KSTACK, 0x40_9999, USER_SP, USER_FP, 0x40_2000, 0, PT_REGS_7)
    words |= zeroed(KSTACK) | {USER_FP: 0, USER_FP + 8: 0}
    fp = KSTACK + PT_REGS_7.record
    assert ENTRY_7.holds_link(USER_HANDLER_PC_UNSAVED)
    raw = walk(USER_HANDLER_PC_UNSAVED, KSTACK, fp, words, ENTRY_7, elr=USER_PC)
    assert raw.pcs == (USER_HANDLER_PC_UNSAVED, USER_PC) and raw.exact == (True, True)
    raw = walk(USER_HANDLER_PC_UNSAVED, KSTACK, fp, words, ENTRY_7)  # ELR_EL1 not read
    assert raw.pcs == (USER_HANDLER_PC_UNSAVED,) and raw.stop is StopReason.END


def test_interrupted_in_a_handler_before_its_record_the_registers_are_the_cpu_s() -> None:
    raw = walk(HANDLER, KSTACK, OUTER, {}, elr=BASE, x30=CALLER)
    assert raw.pcs == (HANDLER, BASE, CALLER) and raw.via[1] is Via.ENTRY
    # In it after the record is set: the saved frame at sp.
    words = pt_regs(KSTACK, BASE, KSTACK + 0x400, OUTER, CALLER)
    raw = walk(HANDLER + 0x58, KSTACK, KSTACK + PT_REGS.record, words)
    assert raw.pcs == (HANDLER + 0x58, BASE, CALLER)
    # On the way back with the record loaded again: not modelled.
    raw = walk(RET_TO_KERNEL + 0x50, KSTACK, OUTER, {}, elr=BASE)
    assert raw.stop is StopReason.NO_CFI


def test_a_saved_frame_from_user_mode_ends_the_walk() -> None:
    words = pt_regs(KSTACK, 0x40_1000, 0x7FFF_F000, 0, 0, status=0)
    raw = walk(HANDLER + 0x58, KSTACK, KSTACK + PT_REGS.record, words)
    assert raw.pcs == (HANDLER + 0x58,) and raw.stop is StopReason.END


def test_a_user_mode_handler_s_saved_frame_hands_over_to_the_user_code() -> None:
    # el0t_64_sync (a user-mode span) called a handler; its record in pt_regs is zeroed (the
    # kernel stack's end) and pt_regs holds the user's registers: the walk goes on at the
    # user's pc, exact, on the user's stack.
    frame = KSTACK + 0x40
    words = pt_regs(frame, 0x40_1000, 0x7FFF_F000, 0x7FFF_F010, 0x40_2000, status=0)
    record = frame + PT_REGS.record
    words |= {record: 0, record + 8: 0}
    words |= {KSTACK + 0x10: record, KSTACK + 0x18: BASE + 0x1310}
    words |= {0x7FFF_F010: 0, 0x7FFF_F018: 0}  # the user's outermost record
    raw = walk(BASE + 0x1000, KSTACK, KSTACK + 0x10, words, x30=BASE + 0x1000)
    assert raw.pcs == (BASE + 0x1000, BASE + 0x1310, 0x40_1000)
    assert raw.exact[:3] == (True, False, True) and raw.via[1:3] == (Via.FRAME_POINTER, Via.ENTRY)
    # Entered from 32-bit code (PSTATE.nRW) or with a record that is not zeroed: the end.
    for changed in ({frame + PT_REGS.status: 0x10}, {record: 0x7FFF_F010}):
        raw = walk(BASE + 0x1000, KSTACK, KSTACK + 0x10, words | changed, x30=BASE + 0x1000)
        assert raw.pcs == (BASE + 0x1000, BASE + 0x1310) and raw.stop is StopReason.END


@pytest.mark.parametrize("index", [0, 3, 8, 9])
def test_in_the_function_a_user_mode_handler_calls_the_kernel_stack_is_two_frames(
    index: int,
) -> None:
    # el0t_64_irq (a user-mode span) called f (el0t_64_irq_handler) with sp at pt_regs and x29
    # at its zeroed record; f caught before its record or after it loaded it back (its caller
    # in x30): f, the handler, then the user's code from pt_regs. Nothing of the kernel's
    # beyond the handler (issue 35).
    frame = KSTACK + 0x40
    words = pt_regs(frame, 0x40_1000, 0x7FFF_F000, 0x7FFF_F010, 0x40_2000, status=0)
    record = frame + PT_REGS.record
    words |= {record: 0, record + 8: 0, 0x7FFF_F010: 0, 0x7FFF_F018: 0}
    raw = walk(BASE + 4 * index, frame, record, words, x30=BASE + 0x1310)
    assert raw.pcs == (BASE + 4 * index, BASE + 0x1310, 0x40_1000)
    assert raw.via == (Via.REGS, Via.PROLOGUE, Via.ENTRY) and raw.exact[2]


@pytest.mark.parametrize("series", ["6.1", "6.12", "7"])
def test_arm64_linux_s_exception_code_is_read_from_its_code(series: str) -> None:
    # From 5.12 the handlers' names say what their code says: the model read from the code
    # is the one those names give (el1h_64_*, el0t_*, ret_to_user, ret_to_kernel).
    kernel = LinuxKernel.load(image(series))
    entry = entry_code(kernel)
    assert isinstance(entry, EntryCode)
    # pt_regs from BTF: the same in 6.1 and 6.12; 7.x's record (a zeroed one, then its kind
    # word: struct frame_record_meta) moved 8 bytes down and the frame is 16 bytes smaller.
    assert entry.frame == (PT_REGS_7 if series == "7" else PT_REGS)
    assert entry.linked is (series != "7")  # 7.x's handlers zero the record (from 6.13)
    # ... and give it a kind (FRAME_META_TYPE_PT_REGS, 2; from user mode FINAL, 1).
    assert entry.record_kind == (2 if series == "7" else None)
    # x29 set, then the pc stored (objdump of each Image): the four el1h_64_* and el0t_64_*.
    kernel_mode, user_mode = {"6.1": (0x58, 0x178), "6.12": (0x58, 0x17C), "7": (0x60, 0x184)}[
        series
    ]
    vectors = kernel.symbols.address_of("vectors")
    assert vectors is not None
    named = {name: (start, end) for start, end, name in kernel.functions.items()}
    kinds = ("sync", "irq", "fiq", "error")
    user = [f"el0t_{bits}_{kind}" for bits in (64, 32) for kind in kinds] + ["ret_to_user"]
    assert set(entry.user) == {named[n] for n in user} | {(vectors + 0x400, vectors + 0x800)}
    assert set(entry.saving) == {named[f"el1h_64_{kind}"] for kind in kinds}
    assert entry.restoring == (named["ret_to_kernel"],)
    unsaved = [(named[f"el1h_64_{kind}"][0], kernel_mode) for kind in kinds]
    unsaved += [(named[f"el0t_64_{kind}"][0], user_mode) for kind in kinds]
    assert set(entry.pc_unsaved) == {(start + off, start + off + 4) for start, off in unsaved}
    # check-kernels' account: every entry's handler of a shape it knows.
    way = "pc saved after it, returns through a branch"
    kernel_record, user_record = {"7": ("zeroed (kind 2)", "zeroed (kind 1)")}.get(
        series, ("{x29, pc}", "zeroed")
    )
    shapes = [f"record {kernel_record}, {way}"] * 4 + [f"record {user_record}, {way}"] * 8
    assert entry_shapes(kernel) == [(0x200 + 0x80 * i, True, s) for i, s in enumerate(shapes)]


@pytest.mark.parametrize(
    ("off", "word", "said"),
    [
        # el1h_64_irq+0x5c: add x29, sp, #0x120, not at pt_regs' record (0x128)
        (0x5C, 0x910483FD, "vectors+0x280: no add x29, sp, #0x128 (pt_regs' record)"),
        (0x50, 0xA9128BE1, "records are not of one shape"),  # +0x50: stp x1, x2, not zeros
        (0x54, 0xD2800060, "records are not of one kind"),  # +0x54: mov x0, #3, not #2
        (0x58, 0xF9009BE0, "records are not of one kind"),  # +0x58: str x0 at 0x130, not 0x138
    ],
)
def test_7x_code_changed_gives_no_model_and_says_where(off: int, word: int, said: str) -> None:
    kernel = LinuxKernel.load(image("7"))
    text, text_addr = bytearray(kernel.image.text_bytes), kernel.image.text_addr
    irq = kernel.symbols.address_of("el1h_64_irq")
    vectors = kernel.symbols.address_of("vectors")
    assert irq is not None and vectors is not None
    at = irq + off - text_addr
    text[at : at + 4] = word.to_bytes(4, "little")
    found = exception_code(Code(bytes(text), text_addr, kernel.functions), vectors, PT_REGS_7)
    assert isinstance(found, str) and said in found, found


# Bullseye's 5.10.0-30-arm64 (not fetched in CI), at offsets from its ``vectors``
# (0xffff800010010800): its functions (kallsyms) from el0_fiq_invalid to finish_ret_to_user,
# and the words of its code the model reads, as its Image has them (every other word a nop
# here): each entry's branches up to its first out of it, the handlers' ``add x29, sp,
# #0x130`` (pt_regs.stackframe), their branches, ``eret``s and ``brk``s.
FUNCTIONS_510 = [
    (0xBB8, 0xD44, "el0_fiq_invalid"),
    (0xD44, 0xED0, "el0_error_invalid"),
    (0xED0, 0x1060, "el0_fiq_invalid_compat"),
    (0x1060, 0x10F4, "el1_sync_invalid"),
    (0x10F4, 0x1188, "el1_irq_invalid"),
    (0x1188, 0x121C, "el1_fiq_invalid"),
    (0x121C, 0x12C0, "el1_error_invalid"),
    (0x12C0, 0x1400, "el1_sync"),
    (0x1400, 0x1580, "el1_irq"),
    (0x1580, 0x1740, "el0_sync"),
    (0x1740, 0x1900, "el0_sync_compat"),
    (0x1900, 0x1A80, "el0_irq_compat"),
    (0x1A80, 0x1C00, "el0_error_compat"),
    (0x1C00, 0x1D78, "el0_irq"),
    (0x1D78, 0x1DCC, "el0_irq_naked"),
    (0x1DCC, 0x1EDC, "el1_error"),
    (0x1EDC, 0x2054, "el0_error"),
    (0x2054, 0x2070, "el0_error_naked"),
    (0x2070, 0x2080, "ret_to_user"),
    (0x2080, 0x21E8, "finish_ret_to_user"),
]
WORDS_510 = {
    0x218: 0x1400042A,  # b el1_sync
    0x298: 0x1400045A,  # b el1_irq
    0x318: 0x1400039C,  # b el1_fiq_invalid
    0x398: 0x1400068D,  # b el1_error
    0x400: 0x14000003,  # b 0x40c
    0x424: 0x14000457,  # b el0_sync
    0x480: 0x14000003,  # b 0x48c
    0x4A4: 0x140005D7,  # b el0_irq
    0x500: 0x14000003,  # b 0x50c
    0x524: 0x140001A5,  # b el0_fiq_invalid
    0x580: 0x14000003,  # b 0x58c
    0x5A4: 0x1400064E,  # b el0_error
    0x600: 0x14000002,  # b 0x608
    0x620: 0x14000448,  # b el0_sync_compat
    0x680: 0x14000002,  # b 0x688
    0x6A0: 0x14000498,  # b el0_irq_compat
    0x700: 0x14000002,  # b 0x708
    0x720: 0x140001EC,  # b el0_fiq_invalid_compat
    0x780: 0x14000002,  # b 0x788
    0x7A0: 0x140004B8,  # b el0_error_compat
    0xC9C: 0x14000007,  # el0_fiq_invalid: b +0x100
    0xCB8: 0x1400000B,  # el0_fiq_invalid: b +0x12c
    0xD0C: 0x9104C3FD,  # el0_fiq_invalid: add x29, sp, #0x130
    0xD40: 0xD4210000,  # el0_fiq_invalid: brk #0x800
    0xFB8: 0x14000007,  # el0_fiq_invalid_compat: b +0x104
    0xFD4: 0x1400000B,  # el0_fiq_invalid_compat: b +0x130
    0x1028: 0x9104C3FD,  # el0_fiq_invalid_compat: add x29, sp, #0x130
    0x105C: 0xD4210000,  # el0_fiq_invalid_compat: brk #0x800
    0x11E8: 0xA9135BFD,  # el1_fiq_invalid: stp x29, x22, [sp, #0x130]
    0x11EC: 0x9104C3FD,  # el1_fiq_invalid: add x29, sp, #0x130
    0x1218: 0xD4210000,  # el1_fiq_invalid: brk #0x800
    0x1320: 0xA9135BFD,  # el1_sync: stp x29, x22, [sp, #0x130]
    0x1324: 0x9104C3FD,  # el1_sync: add x29, sp, #0x130
    0x13BC: 0xD69F03E0,  # el1_sync: eret
    0x1460: 0xA9135BFD,  # el1_irq: stp x29, x22, [sp, #0x130]
    0x1464: 0x9104C3FD,  # el1_irq: add x29, sp, #0x130
    0x154C: 0xD69F03E0,  # el1_irq: eret
    0x1664: 0x14000007,  # el0_sync: b +0x100
    0x1680: 0x1400000B,  # el0_sync: b +0x12c
    0x16D4: 0x9104C3FD,  # el0_sync: add x29, sp, #0x130
    0x1700: 0x1400025C,  # el0_sync: b ret_to_user
    0x1828: 0x14000007,  # el0_sync_compat: b +0x104
    0x1844: 0x1400000B,  # el0_sync_compat: b +0x130
    0x1898: 0x9104C3FD,  # el0_sync_compat: add x29, sp, #0x130
    0x18C4: 0x140001EB,  # el0_sync_compat: b ret_to_user
    0x19E8: 0x14000007,  # el0_irq_compat: b +0x104
    0x1A04: 0x1400000B,  # el0_irq_compat: b +0x130
    0x1A58: 0x9104C3FD,  # el0_irq_compat: add x29, sp, #0x130
    0x1A7C: 0x140000BF,  # el0_irq_compat: b el0_irq_naked
    0x1B68: 0x14000007,  # el0_error_compat: b +0x104
    0x1B84: 0x1400000B,  # el0_error_compat: b +0x130
    0x1BD8: 0x9104C3FD,  # el0_error_compat: add x29, sp, #0x130
    0x1BFC: 0x14000116,  # el0_error_compat: b el0_error_naked
    0x1CE4: 0x14000007,  # el0_irq: b +0x100
    0x1D00: 0x1400000B,  # el0_irq: b +0x12c
    0x1D54: 0x9104C3FD,  # el0_irq: add x29, sp, #0x130
    0x1DC8: 0x140000AA,  # el0_irq_naked: b ret_to_user
    0x1E2C: 0xA9135BFD,  # el1_error: stp x29, x22, [sp, #0x130]
    0x1E30: 0x9104C3FD,  # el1_error: add x29, sp, #0x130
    0x1ED0: 0xD69F03E0,  # el1_error: eret
    0x1FC0: 0x14000007,  # el0_error: b +0x100
    0x1FDC: 0x1400000B,  # el0_error: b +0x12c
    0x2030: 0x9104C3FD,  # el0_error: add x29, sp, #0x130
    0x206C: 0x14000001,  # el0_error_naked: b ret_to_user
    0x207C: 0xB5000B62,  # ret_to_user: cbnz x2, work_pending (it goes on into the next)
    0x20CC: 0x1400000D,  # finish_ret_to_user: b +0x80
    0x210C: 0x1400000B,  # finish_ret_to_user: b +0xb8
    0x2184: 0xD69F03E0,  # finish_ret_to_user: eret
    0x21B4: 0xD61F03C0,  # finish_ret_to_user: br x30
    0x21DC: 0xD61F03C0,  # finish_ret_to_user: br x30
}
V510 = 0xFFFF_8000_1001_0800
NOP_WORD = 0xD503201F


def code_510(words: dict[int, int]) -> Code:
    text = bytearray(NOP_WORD.to_bytes(4, "little") * (FUNCTIONS_510[-1][1] // 4))
    for off, word in words.items():
        text[off : off + 4] = word.to_bytes(4, "little")
    symbols = SymbolTable(Symbol(V510 + start, end - start, n) for start, end, n in FUNCTIONS_510)
    return Code(bytes(text), V510, symbols)


def spans_510(*names: str) -> set[tuple[int, int]]:
    return {(V510 + s, V510 + e) for s, e, name in FUNCTIONS_510 if name in names}


def test_bullseye_510_s_exception_code_is_read_from_its_code() -> None:
    entry = exception_code(code_510(WORDS_510), V510, PT_REGS)
    assert entry is not None
    # Kernel-mode handlers that eret themselves: saving up to their record, the way back after.
    ends = {"el1_sync": 0x1400, "el1_irq": 0x1580, "el1_error": 0x1EDC}
    records = {"el1_sync": 0x1328, "el1_irq": 0x1468, "el1_error": 0x1E34}  # after add x29
    starts = {"el1_sync": 0x12C0, "el1_irq": 0x1400, "el1_error": 0x1DCC}
    assert set(entry.saving) == {
        (V510 + starts[n], V510 + records[n]) for n in starts
    } | spans_510("el1_fiq_invalid")  # fmt: skip
    assert set(entry.restoring) == {(V510 + records[n], V510 + ends[n]) for n in starts}
    # From user mode: the handlers, what they branch or fall through to (el0_irq into
    # el0_irq_naked), up to finish_ret_to_user's eret; not el1_error between them.
    user = spans_510(
        "el0_sync", "el0_irq", "el0_fiq_invalid", "el0_error", "el0_sync_compat",
        "el0_irq_compat", "el0_fiq_invalid_compat", "el0_error_compat", "el0_irq_naked",
        "el0_error_naked", "ret_to_user", "finish_ret_to_user",
    )  # fmt: skip
    assert set(entry.user) == user | {(V510 + 0x400, V510 + 0x800)}
    assert entry.entries == tuple(V510 + off for off in (0x200, 0x280, 0x300, 0x380))
    # The user's registers still the CPU's at the 64-bit user handlers' first instruction.
    (el0_sync, _), *_ = sorted(spans_510("el0_sync"))
    assert entry.holds_user(el0_sync) and not entry.holds_user(el0_sync + 4)
    assert entry.holds_user(V510 + 0x400) and not entry.holds_user(V510 + 0x604)


@pytest.mark.parametrize(
    ("off", "word", "said"),
    [
        (0x218, NOP_WORD, "vectors+0x200: no branch out"),  # el1_sync's entry
        (0x424, 0x14000458, "vectors+0x400: a branch to"),  # el0_sync's: to no function's start
        (0x1464, 0x910483FD, "vectors+0x280: no add x29, sp, #0x130"),  # el1_irq: #0x120
        (0x1320, NOP_WORD, "records"),  # el1_sync: nothing stored in its record
        (0x1460, 0xA913FFFF, "records"),  # el1_irq: stp xzr, xzr (the others link it)
        (0x1460, 0xA9135BE0, "records"),  # el1_irq: stp x0, x22, not x29 and the pc
        (0x1DC8, 0x910003E0, "lead out"),  # el0_irq_naked: mov x0, sp, on into el1_error
    ],
)
def test_bullseye_510_s_code_changed_gives_no_model(off: int, word: int, said: str) -> None:
    found = exception_code(code_510(WORDS_510 | {off: word}), V510, PT_REGS)
    assert isinstance(found, str) and said in found, found


class SystemRegisters:
    """A transport that answers system registers only, and keeps what it was asked."""

    def __init__(self, elr: int, sp_el0: int | None = None) -> None:
        self.values = {"ELR_EL1": elr} | ({} if sp_el0 is None else {"SP_EL0": sp_el0})
        self.asked: list[tuple[int, tuple[str, ...]]] = []

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        self.asked.append((cpu, tuple(names)))
        return {name: self.values[name] for name in names if name in self.values}


async def test_the_linux_guest_reads_elr_for_a_sample_at_a_kernel_mode_entry_only() -> None:
    slide = 0x3A3A_C120_0000
    identifier = LinuxIdentifier(space(slide).modules, ARCH, entry=ENTRY)
    stub = SystemRegisters(BASE + slide)
    transport = cast(GuestTransport, stub)
    for pc in (VECTORS + 0x280, HANDLER):
        identity = await identifier.identify(
            transport, kregs(pc + slide, KSTACK, OUTER), PageCache()
        )
        assert identity.registers is not None and identity.registers.gprs[ELR] == BASE + slide
    assert stub.asked == [(0, ("ELR_EL1",))] * 2
    # In a function, a kernel-mode vector's link address (not slid), past a user entry's start.
    for pc in (BASE + slide, VECTORS + 0x280, VECTORS + 0x484 + slide):
        identity = await identifier.identify(transport, kregs(pc, KSTACK, OUTER), PageCache())
        assert identity.registers is None
    assert len(stub.asked) == 2


async def test_the_linux_guest_reads_elr_and_sp_el0_for_a_sample_entered_from_user_mode() -> None:
    slide = 0x3A3A_C120_0000
    identifier = LinuxIdentifier(space(slide).modules, ARCH, entry=ENTRY)
    stub = SystemRegisters(USER_PC, USER_SP)
    regs = kregs(VECTORS + 0x480 + slide, KSTACK, USER_FP)
    identity = await identifier.identify(cast(GuestTransport, stub), regs, PageCache())
    assert stub.asked == [(0, ("ELR_EL1", "SP_EL0"))]
    assert identity.registers is not None
    assert identity.registers.gprs[ELR] == USER_PC and identity.registers.gprs[SP_EL0] == USER_SP
    # A transport that gives no user stack pointer: the registers as sampled (one frame).
    stub = SystemRegisters(USER_PC)
    identity = await identifier.identify(cast(GuestTransport, stub), regs, PageCache())
    assert identity.registers is None


async def test_a_module_loaded_below_the_kernel_does_not_hide_its_slide() -> None:
    # arm64 loads modules below the image: the space's first module is then one of them, and
    # the kernel's slide (for the entry code's link addresses) is the image's own.
    slide = 0x3A3A_C120_0000
    below = Module.build(Mapping("[qmpprof_burn]", BASE + slide - 0x10_0000, BASE, True), ARCH)
    identifier = LinuxIdentifier([*space(slide).modules, below], ARCH, entry=ENTRY)
    assert identifier.space.modules[0] is below
    stub = SystemRegisters(BASE + slide)
    identity = await identifier.identify(
        cast(GuestTransport, stub), kregs(VECTORS + 0x280 + slide, KSTACK, OUTER), PageCache()
    )
    assert identity.registers is not None and identity.registers.gprs[ELR] == BASE + slide
