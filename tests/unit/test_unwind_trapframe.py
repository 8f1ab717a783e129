"""A trap frame still being built: TrapFrameStep at every pc of hand-assembled i386 entry code
(two vector stubs and the common entry that calls the handler), over a stack laid out as the
CPU and each instruction before the pc pushed it."""

from __future__ import annotations

import struct

import pytest
from fakes import x86

from qmpprof.arch.base import PathToCall
from qmpprof.arch.x86 import I386, X86_64
from qmpprof.elf.trapframe import TrapFrameLayout
from qmpprof.model import Mapping, StopReason
from qmpprof.pagecache import PAGE, PageCache, page_of
from qmpprof.unwind.chain import AddressSpace, Module, Unwinder
from qmpprof.unwind.steps import EXACT
from qmpprof.unwind.trapframe import TrapFrameStep

EIP, ESP, EBP = I386.pc, I386.sp, I386.fp
CODE_ADDR = 0x8010_0000
VEC_ERR, VEC, ALLTRAPS = CODE_ADDR, CODE_ADDR + 7, CODE_ADDR + 16
CALL = ALLTRAPS + 18
HANDLER = CALL + 8


def rel32(target: int, end: int) -> bytes:
    return struct.pack("<i", target - end)


# (address, bytes, the words the instruction pushes: "esp" for the stack pointer before it).
INSNS: tuple[tuple[int, bytes, tuple[int | str, ...]], ...] = (
    (VEC_ERR, b"\x6a\x0e", (14,)),  # push $14: the CPU pushed the error code
    (VEC_ERR + 2, b"\xe9" + rel32(ALLTRAPS, VEC_ERR + 7), ()),  # jmp alltraps
    (VEC, b"\x6a\x00", (0,)),  # push $0: no error code from the CPU
    (VEC + 2, b"\x6a\x40", (64,)),  # push $64
    (VEC + 4, b"\xe9" + rel32(ALLTRAPS, VEC + 9), ()),  # jmp alltraps
    (ALLTRAPS, b"\x1e", (0x23,)),  # push %ds
    (ALLTRAPS + 1, b"\x06", (0x23,)),  # push %es
    (ALLTRAPS + 2, b"\x0f\xa0", (0,)),  # push %fs
    (ALLTRAPS + 4, b"\x0f\xa8", (0,)),  # push %gs
    (ALLTRAPS + 6, b"\x60", (1, 2, 3, 4, "esp", "ebp", 5, 6)),  # pushal: eax .. edi
    (ALLTRAPS + 7, b"\x66\xb8\x10\x00", ()),  # mov $0x10, %ax
    (ALLTRAPS + 11, b"\x8e\xd8", ()),  # mov %eax, %ds
    (ALLTRAPS + 13, b"\x8e\xc0", ()),  # mov %eax, %es
    (ALLTRAPS + 15, b"\x89\xdd", ()),  # mov %ebx, %ebp: the saved ebp no longer in its register
    (CALL - 1, b"\x54", ("esp",)),  # push %esp: the frame's address, trap(tf)'s argument
    (CALL, b"\xe8" + rel32(HANDLER, CALL + 5), ()),  # call trap
    (CALL + 5, b"\x83\xc4\x04", ()),  # add $4, %esp
    (HANDLER, b"\xc3", ()),  # trap: ret
)
CODE = b"".join(code for _, code, _ in INSNS)
# struct trapframe as the entry builds it: 8 pushal words, 4 segments, trapno, err, then eip.
LAYOUT = TrapFrameLayout(HANDLER, 0, pc=56, sp=68, fp=8)
KSTACK_TOP = 0x8030_0000
USER_PC, USER_SP, USER_EBP, USER_CALLER = 0x40_1068, 0x7F_FF00, 0x7F_FF10, 0x40_1200


def stack_at(pc: int, start: int, cpu: tuple[int, ...]) -> tuple[PageCache, int, int]:
    """Memory, the stack pointer and ebp when the CPU entered at ``start`` (having pushed
    ``cpu``, lowest word first) and ran each instruction up to ``pc``."""
    sp = KSTACK_TOP - 4 * len(cpu)
    words = {sp + 4 * i: value for i, value in enumerate(cpu)}
    ebp, at = USER_EBP, start
    while at != pc:
        addr, code, pushed = next(insn for insn in INSNS if insn[0] == at)
        before = sp
        for value in pushed:
            sp -= 4
            words[sp] = before if value == "esp" else USER_EBP if value == "ebp" else int(value)
        ebp = 0xDEAD if code == b"\x89\xdd" else ebp
        jump = code[0] == 0xE9
        at = addr + len(code) + (struct.unpack("<i", code[1:])[0] if jump else 0)
    words[USER_EBP], words[USER_EBP + 4] = 0, USER_CALLER  # the user's frame record
    return memory_of(words, "<I"), sp, ebp


def memory_of(words: dict[int, int], word: str) -> PageCache:
    """Pages holding ``words`` (address -> value, packed as ``word``), zeros around them."""
    cache = PageCache()
    for addr, value in words.items():
        page = bytearray(cache.pages.get(page_of(addr)) or bytes(PAGE))
        struct.pack_into(word, page, addr - page_of(addr), value)
        cache.pages[page_of(addr)] = bytes(page)
    return cache


def pcs_from(
    start: int,
    insns: tuple[tuple[int, bytes, tuple[int | str, ...]], ...] = INSNS,
    call: int = CALL,
) -> list[int]:
    """Each instruction's address on the way from ``start`` to the call, the call's included."""
    out, at = [], start
    while at <= call:
        out.append(at)
        _, code, _ = next(insn for insn in insns if insn[0] == at)
        at = at + len(code) + (struct.unpack("<i", code[1:])[0] if code[0] == 0xE9 else 0)
    return out


USER_FRAME = (USER_PC, 0x1B, 0x202, USER_SP, 0x23)  # eip, cs (ring 3), eflags, esp, ss
STEP = TrapFrameStep(LAYOUT, CODE, CODE_ADDR, 0, I386)


@pytest.mark.parametrize("pc", pcs_from(VEC))
def test_from_user_mode_at_each_pc_the_cpus_frame_gives_the_user_registers(pc: int) -> None:
    cache, sp, ebp = stack_at(pc, VEC, USER_FRAME)
    found = STEP.step({EIP: pc, ESP: sp, EBP: ebp}, pc, True, cache)
    assert found == ({EIP: USER_PC, ESP: USER_SP, EBP: USER_EBP}, EXACT)


@pytest.mark.parametrize("pc", pcs_from(VEC_ERR))
def test_below_an_error_code_the_cpu_pushed(pc: int) -> None:
    cache, sp, ebp = stack_at(pc, VEC_ERR, (0x7, *USER_FRAME))  # the error code lowest
    found = STEP.step({EIP: pc, ESP: sp, EBP: ebp}, pc, True, cache)
    assert found == ({EIP: USER_PC, ESP: USER_SP, EBP: USER_EBP}, EXACT)


@pytest.mark.parametrize("pc", pcs_from(VEC))
def test_from_kernel_mode_the_interrupted_stack_goes_on_above_the_cpus_frame(pc: int) -> None:
    kernel_pc = HANDLER  # any kernel code: cs ring 0, so no esp and ss were pushed
    cache, sp, ebp = stack_at(pc, VEC, (kernel_pc, 0x08, 0x202))
    found = STEP.step({EIP: pc, ESP: sp, EBP: ebp}, pc, True, cache)
    assert found == ({EIP: kernel_pc, ESP: KSTACK_TOP, EBP: USER_EBP}, EXACT)


def test_code_that_does_not_go_straight_to_the_handler_is_left_to_other_steps() -> None:
    cache, sp, ebp = stack_at(VEC, VEC, USER_FRAME)
    for pc in (CALL + 5, HANDLER):  # after the call; a ret on the way
        assert STEP.step({EIP: pc, ESP: sp, EBP: ebp}, pc, True, cache) is None


def test_an_argument_that_is_no_stack_address_stops_the_walk() -> None:
    # push $0; call trap: the handler's argument says nothing of where a frame lies.
    code = b"\x6a\x00\xe8" + rel32(HANDLER, CODE_ADDR + 7)
    step = TrapFrameStep(LAYOUT, code + b"\x90" * (HANDLER - CODE_ADDR - 7), CODE_ADDR, 0, I386)
    cache, sp, ebp = stack_at(VEC, VEC, USER_FRAME)
    assert step.step({EIP: CODE_ADDR, ESP: sp, EBP: ebp}, CODE_ADDR, True, cache) == (
        StopReason.NO_CFI
    )


def test_a_walk_stopped_after_pushal_crosses_into_the_user_chain() -> None:
    """The moment of issue 34: stopped in the common entry after its pushes of the registers,
    the walk goes on at the pc and stack the CPU pushed, then the user's frame record."""
    pc = ALLTRAPS + 11
    cache, sp, ebp = stack_at(pc, VEC, USER_FRAME)
    kernel = Module.build(
        Mapping("kernel", CODE_ADDR, CODE_ADDR + len(CODE), True), I386,
        code=CODE, code_addr=CODE_ADDR, trap=LAYOUT,
    )  # fmt: skip
    regs = x86(0, pc, sp, ebp, cpl=0, cr3=0, long_mode=False)
    raw = Unwinder(I386, kernel_boundary=0x8000_0000).unwind(regs, cache, AddressSpace([kernel]))
    assert raw.pcs == (pc, USER_PC, USER_CALLER)
    assert raw.exact[:2] == (True, True)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        # mov %ebx, %ebp; push %ebp; push %eax; push %esp: ebp written first, eax as it is.
        ("89 dd 55 50 54", PathToCall(12, ((-8, 0),), ((-12, -8),))),
        ("66 50 54", None),  # push %ax: two bytes, not modelled
        ("83 c4 04 54", None),  # add $4, %esp: the stack moved otherwise
        ("74 00 54", None),  # a conditional jump
        ("9c 54", PathToCall(8, (), ((-8, -4),))),  # pushfd: a word of flags
        # The i386 test guest's isr_common: push %ebp; mov %esp,%ebp; lea 8(%esp),%eax;
        # push %eax: the argument is the stack address lea took, 4 above the pc's stack.
        ("55 89 e5 8d 44 24 08 50", PathToCall(8, ((-4, 5),), ((-8, 4),))),
        ("89 e0 50", PathToCall(4, (), ((-4, 0),))),  # mov %esp,%eax; push %eax
        ("8d 44 24 f8 50", PathToCall(4, (), ((-4, -8),))),  # lea -8(%esp),%eax; push %eax
        ("8d 44 24 08 31 c0 50", PathToCall(4, (), ())),  # ... xor %eax,%eax: no address now
        ("8d 04 24 89 c3 53", PathToCall(4, (), ())),  # mov %eax,%ebx: not followed
    ],
)
def test_the_way_to_the_call_and_what_it_pushes(code: str, expected: PathToCall | None) -> None:
    body = bytes.fromhex(code)
    end = CODE_ADDR + len(body) + 5
    whole = body + b"\xe8" + rel32(HANDLER, end) + b"\x90" * (HANDLER - end + 1)
    found = I386.path_to_call(whole, CODE_ADDR, CODE_ADDR, HANDLER)
    pushed = None if found is None else PathToCall(found.depth, found.saved, found.addresses)
    assert pushed == expected


# x86_64: the entry of fixtures/hobby64 in short. The handler takes the frame in rdi, set from
# the stack pointer right before the call; r15 pushes as two bytes.
VEC64 = CODE_ADDR
ALLTRAPS64 = VEC64 + 9
CALL64 = ALLTRAPS64 + 8
HANDLER64 = CALL64 + 8
RAX, RDI, R15 = 0, 5, 15
INSNS64: tuple[tuple[int, bytes, tuple[int | str, ...]], ...] = (
    (VEC64, b"\x6a\x00", (0,)),  # push $0: no error code from the CPU
    (VEC64 + 2, b"\x6a\x40", (64,)),  # push $64
    (VEC64 + 4, b"\xe9" + rel32(ALLTRAPS64, VEC64 + 9), ()),  # jmp alltraps
    (ALLTRAPS64, b"\x41\x57", ("r15",)),  # push %r15
    (ALLTRAPS64 + 2, b"\x55", ("rbp",)),  # push %rbp
    (ALLTRAPS64 + 3, b"\x57", ("rdi",)),  # push %rdi
    (ALLTRAPS64 + 4, b"\x50", ("rax",)),  # push %rax
    (ALLTRAPS64 + 5, b"\x48\x89\xe7", ()),  # mov %rsp, %rdi: trap(tf)'s argument
    (CALL64, b"\xe8" + rel32(HANDLER64, CALL64 + 5), ()),  # call trap
    (CALL64 + 5, b"\x58", ()),  # trapret: pop %rax ...
    (CALL64 + 6, b"\x90" * 2, ()),
    (HANDLER64, b"\xc3", ()),  # trap: ret
)
CODE64 = b"".join(code for _, code, _ in INSNS64)
# rax, rdi, rbp, r15, trapno, err, then what the CPU pushed: rip, cs, rflags, rsp, ss.
LAYOUT64 = TrapFrameLayout(
    HANDLER64, 0, pc=48, sp=72, fp=16, register=RDI, registers=((RAX, 0), (RDI, 8), (R15, 24))
)
USER64 = (USER_PC, 0x1B, 0x202, USER_SP, 0x23)
REGS64 = {"r15": 15, "rbp": USER_EBP, "rdi": 0x51, "rax": 0xA}


def stack64_at(pc: int) -> tuple[PageCache, dict[int, int]]:
    """Memory and the registers when the CPU entered the vector (from user mode) and ran each
    instruction up to ``pc``."""
    sp = KSTACK_TOP - 8 * len(USER64)
    words = {sp + 8 * i: value for i, value in enumerate(USER64)}
    rdi, at = REGS64["rdi"], VEC64
    while at != pc:
        addr, code, pushed = next(insn for insn in INSNS64 if insn[0] == at)
        for value in pushed:
            sp -= 8
            words[sp] = REGS64[value] if isinstance(value, str) else value
        rdi = sp if code == b"\x48\x89\xe7" else rdi
        jump = code[0] == 0xE9
        at = addr + len(code) + (struct.unpack("<i", code[1:])[0] if jump else 0)
    words[USER_EBP], words[USER_EBP + 8] = 0, USER_CALLER
    cache = memory_of(words, "<Q")
    regs = {X86_64.pc: pc, X86_64.sp: sp, X86_64.fp: USER_EBP, RDI: rdi, RAX: 0xA, R15: 15}
    return cache, regs


@pytest.mark.parametrize("pc", pcs_from(VEC64, INSNS64, CALL64))
def test_x86_64_a_frame_whose_address_the_handler_takes_in_rdi_is_crossed_at_each_pc(
    pc: int,
) -> None:
    """The frame the handler will take in rdi (``mov %rsp, %rdi`` right before the call), from
    each pc of the way there: the user's registers the CPU pushed, the frame pointer pushed by
    the entry (or still in its register)."""
    step = TrapFrameStep(LAYOUT64, CODE64, CODE_ADDR, 0, X86_64)
    cache, regs = stack64_at(pc)
    outcome = step.step(regs, pc, True, cache)
    assert isinstance(outcome, tuple), outcome
    new, how = outcome
    assert (new[X86_64.pc], new[X86_64.sp], new[X86_64.fp]) == (USER_PC, USER_SP, USER_EBP)
    assert how == EXACT


def test_x86_64_at_the_return_from_the_handler_the_frame_is_at_the_stack_pointer() -> None:
    step = TrapFrameStep(LAYOUT64, CODE64, CODE_ADDR, 0, X86_64)
    cache, regs = stack64_at(CALL64)  # the handler returns with the stack as at the call
    outcome = step.step({**regs, X86_64.pc: CALL64 + 5 - 1}, CALL64 + 5 - 1, False, cache)
    assert isinstance(outcome, tuple), outcome
    new, _ = outcome
    assert (new[X86_64.pc], new[X86_64.sp], new[X86_64.fp]) == (USER_PC, USER_SP, USER_EBP)
    # The other registers as the frame kept them (rdi: the user's, not the frame's address).
    assert (new[RDI], new[RAX], new[R15]) == (REGS64["rdi"], REGS64["rax"], REGS64["r15"])


def test_x86_64_the_way_says_which_registers_hold_stack_addresses_and_which_it_writes() -> None:
    found = X86_64.path_to_call(CODE64, CODE_ADDR, ALLTRAPS64, HANDLER64)
    assert found is not None and found.depth == 32 and dict(found.held) == {RDI: -32}
    assert found.saved == ((-8, R15), (-16, X86_64.fp), (-24, RDI), (-32, RAX))
    assert RDI in found.written and RAX not in found.written
