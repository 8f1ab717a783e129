"""The walk through a kernel's exception code (``unwind/entry.py``) over hand-made stacks: a
sample entered from user mode is one whole frame, one at a kernel-mode vector entry continues
at the exception link register, a handler's frame record leads into the saved registers (the
interrupted pc exact, then analysed as the interrupted frame); and arm64 Linux's description
read from bookworm's 6.1 and 6.12 Images (``guest/linux/entry.py``), and the Linux guest reading
the exception link register for the samples that need it, only those."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest
from aarch64vm import image
from test_arch_aarch64 import TCR_48, kregs
from test_arch_aarch64code import BASE, F
from test_unwind_chain import memory

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.aarch64code import LR
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.guest.linux.entry import ELR, entry_code
from qmpprof.guest.linux.identify import LinuxIdentifier
from qmpprof.linux.kernel import LinuxKernel
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
)
KSTACK = 0xFFFF_8000_0800_8000
OUTER = KSTACK + 0x800  # the outermost record: [0, 0]
ARCH = AARCH64.translated({"TCR_EL1": TCR_48})


def space(slide: int = 0) -> AddressSpace:
    text = F + bytes(0x2000 - len(F))
    symbols = SymbolTable(
        [Symbol(BASE, len(F), "f"), Symbol(HANDLER, 0x68, "el1h_64_irq"),
         Symbol(BASE + 0x1800, 0x100, "caller")]
    )  # fmt: skip
    module = Module.build(
        Mapping("vmlinux", BASE + slide, BASE + slide + 0x2000, True, slide), ARCH, code=text,
        code_addr=BASE, symbols=symbols, entry=ENTRY,
    )  # fmt: skip
    return AddressSpace([module])


def walk(pc: int, sp: int, fp: int, words: dict[int, int], **gprs: int) -> RawStack:
    regs = kregs(pc, sp, fp)
    regs.gprs.update({ELR if name == "elr" else LR: value for name, value in gprs.items()})
    return Unwinder(ARCH).unwind(regs, memory(words | {OUTER: 0, OUTER + 8: 0}), space())


@pytest.mark.parametrize("pc", [VECTORS + 0x480, VECTORS + 0x600, BASE + 0x1300, BASE + 0x13FC])
def test_entered_from_user_mode_the_kernel_stack_is_one_frame(pc: int) -> None:
    raw = walk(pc, KSTACK, 0x7FFF_F000, {})  # x29: the user's
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


def pt_regs(base: int, pc: int, sp: int, fp: int, lr: int, status: int = 0x3C5) -> dict[int, int]:
    """A saved frame at ``base``: x29, x30, sp, pc, pstate, and its record {x29, pc}."""
    record = base + PT_REGS.record
    return {
        base + 29 * 8: fp, base + 30 * 8: lr, base + PT_REGS.sp: sp, base + PT_REGS.pc: pc,
        base + PT_REGS.status: status, record: fp, record + 8: pc,
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


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_arm64_linux_describes_its_exception_code(series: str) -> None:
    kernel = LinuxKernel.load(image(series))
    entry = entry_code(kernel)
    assert entry is not None
    assert entry.frame == PT_REGS  # pt_regs from BTF: the same in 6.1 and 6.12
    vectors = kernel.symbols.address_of("vectors")
    irq = kernel.symbols.address_of("el1h_64_irq")
    assert vectors is not None and irq is not None
    assert entry.entries == tuple(vectors + off for off in (0x200, 0x280, 0x300, 0x380))
    assert entry.holds_link(vectors + 0x280) and entry.holds_link(irq)
    assert not entry.holds_link(vectors + 0x480)
    for name in ("el0t_64_sync", "el0t_32_irq", "ret_to_user"):
        start = kernel.symbols.address_of(name)
        assert start is not None and any(s == start for s, _ in entry.user), name
    assert len(entry.saving) == 4 and len(entry.restoring) == 1


class SystemRegisters:
    """A transport that answers system registers only, and keeps what it was asked."""

    def __init__(self, elr: int) -> None:
        self.elr = elr
        self.asked: list[tuple[int, tuple[str, ...]]] = []

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        self.asked.append((cpu, tuple(names)))
        return {"ELR_EL1": self.elr}


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
    # From user mode, in a function, and a kernel-mode vector's link address (not slid).
    for pc in (VECTORS + 0x480 + slide, BASE + slide, VECTORS + 0x280):
        identity = await identifier.identify(transport, kregs(pc, KSTACK, OUTER), PageCache())
        assert identity.registers is None
    assert len(stub.asked) == 2


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
