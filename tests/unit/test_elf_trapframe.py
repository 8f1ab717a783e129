"""trap_frame_layout on real kernels, and TrapFrameStep over a hand-built trap frame."""

from __future__ import annotations

import struct

import pytest
from guestvm import BUILD_ROOT, build_fixtures
from test_unwind_chain import memory

from qmpprof.arch.x86 import I386, X86_64
from qmpprof.elf.image import ElfImage
from qmpprof.elf.trapframe import TrapFrameLayout, trap_frame_layout
from qmpprof.pagecache import PAGE, PageCache, page_of
from qmpprof.unwind.steps import EXACT
from qmpprof.unwind.trapframe import TrapFrameStep

EIP, ESP, EBP = I386.pc, I386.sp, I386.fp


def test_the_hobby_kernels_trap_frame_as_its_source_lays_it_out() -> None:
    build_fixtures(("hobby",))
    image = ElfImage.load(BUILD_ROOT / "hobby" / "kernel.elf")
    layout = trap_frame_layout(image)
    assert layout is not None
    # fixtures/hobby/kernel.h struct trapframe: 8 pushal words, 4 segment words, trapno, err,
    # then eip, cs, eflags, esp; ebp is pushal's third word. trap(tf) takes tf on the stack.
    assert (layout.pc, layout.sp, layout.fp, layout.argument) == (56, 68, 8, 0)
    assert layout.handler == image.symbols.address_of("trap")


@pytest.mark.parametrize("name", ["hobby64", "hobbyrs"])
def test_x86_64_kernels_hand_their_trap_frame_in_rdi(name: str) -> None:
    build_fixtures((name,))
    image = ElfImage.load(BUILD_ROOT / name / "kernel.elf")
    layout = trap_frame_layout(image)
    assert layout is not None
    # struct trapframe (fixtures/hobby64/kernel.h; TrapFrame in fixtures/hobbyrs/kernel.rs):
    # rax .. r15 (rbp the seventh word), trapno, err, then rip, cs, rflags, rsp. trap(tf) takes
    # tf in rdi (DWARF register 5); the Rust kernel's trap lies in its crate's namespace.
    assert (layout.pc, layout.sp, layout.fp, layout.register) == (136, 160, 48, 5)
    assert layout.handler == image.symbols.address_of("trap")
    kept = dict(layout.registers)
    assert kept[X86_64.names.index("rax")] == 0 and kept[X86_64.names.index("r15")] == 112


def test_a_kernel_whose_handlers_take_no_trap_frame_has_none() -> None:
    build_fixtures(("hobby",))
    assert trap_frame_layout(ElfImage.load(BUILD_ROOT / "hobby" / "user" / "crunch.elf")) is None


HANDLER, STUB, FRAME, KSP = 0x8010_0200, 0x8010_0100, 0x8020_0F00, 0x8020_0EF0
LAYOUT = TrapFrameLayout(HANDLER, 0, pc=56, sp=68, fp=8)
# The stub: "push %esp" then "call HANDLER" (e8 rel32) at STUB: the return address is STUB + 6.
CODE = b"\x54" + b"\xe8" + struct.pack("<i", HANDLER - (STUB + 6))


def frame_memory(pc: int, sp: int) -> PageCache:
    cache = memory({})
    page = bytearray(PAGE)
    for addr, value in ((KSP, FRAME), (FRAME + 56, pc), (FRAME + 68, sp), (FRAME + 8, 0x1234)):
        struct.pack_into("<I", page, addr - page_of(FRAME), value)
    cache.pages[page_of(FRAME)] = bytes(page)
    return cache


def test_the_step_crosses_into_user_code_with_its_pc_exact() -> None:
    step = TrapFrameStep(LAYOUT, CODE, STUB, 0, I386)
    found = step.step(
        {EIP: STUB + 6, ESP: KSP, EBP: 0}, STUB + 5, False, frame_memory(0x40, 0x3FFF00)
    )
    assert found == ({EIP: 0x40, ESP: 0x3FFF00, EBP: 0x1234}, EXACT)


def test_a_trap_from_kernel_code_left_its_stack_where_the_sp_slot_is() -> None:
    step = TrapFrameStep(LAYOUT, CODE, STUB, 0, I386)
    found = step.step({EIP: STUB + 6, ESP: KSP, EBP: 0}, STUB + 5, False, frame_memory(STUB, 7))
    assert found == ({EIP: STUB, ESP: FRAME + 68, EBP: 0x1234}, EXACT)


def test_no_call_to_the_handler_no_trap_frame() -> None:
    step = TrapFrameStep(LAYOUT, b"\x90" * 6, STUB, 0, I386)
    assert (
        step.step({EIP: STUB + 6, ESP: KSP, EBP: 0}, STUB + 5, False, frame_memory(0x40, 1)) is None
    )
