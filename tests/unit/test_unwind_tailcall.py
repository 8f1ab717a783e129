"""Tail-call frames from machine code (qmpprof.unwind.tailcall) over hand-built code: each
function's bytes written instruction by instruction (one comment each), kallsyms-like symbols
(starts, sizes to the next symbol), and the frames gdb shows from DWARF call sites for the
same code, chosen the way its ``call_site_find_chain`` chooses them."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.base import InstructionSet
from qmpprof.arch.riscv64 import RISCV64
from qmpprof.arch.x86 import X86_64
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.linux.x86_64.running import target_kind
from qmpprof.model import Mapping, StopReason
from qmpprof.unwind.chain import AddressSpace, Module, RawStack, Unwinder
from qmpprof.unwind.tailcall import CodeImage, Outcome, TailCallFinder, with_tail_calls

TEXT = 0xFFFF_FFFF_8100_0000
SIZE = 0x40  # every function below is SIZE bytes, int3-filled after its code


def call(at: int, to: int) -> bytes:
    """``call rel32`` at address ``at``."""
    return b"\xe8" + struct.pack("<i", to - (at + 5))


def jmp(at: int, to: int) -> bytes:
    """``jmp rel32`` at address ``at``."""
    return b"\xe9" + struct.pack("<i", to - (at + 5))


def jmp8(at: int, to: int) -> bytes:
    """``jmp rel8``."""
    return b"\xeb" + struct.pack("<b", to - (at + 2))


def je(at: int, to: int) -> bytes:
    """``je rel32`` (0f 84): a conditional tail call."""
    return b"\x0f\x84" + struct.pack("<i", to - (at + 6))


Encode = Callable[[int, int], bytes]  # (address, target) -> the instruction's bytes


class Code:
    """Functions laid out one after another from TEXT, SIZE bytes each, filled with ``fill``
    (x86's int3 unless told) after their code."""

    def __init__(self, *names: str, arch: InstructionSet = X86_64, fill: bytes = b"\xcc") -> None:
        self.names, self.arch = names, arch
        self.data = bytearray(fill * (SIZE * len(names) // len(fill)))

    def at(self, name: str) -> int:
        return TEXT + SIZE * self.names.index(name)

    def put(self, name: str, *parts: bytes | tuple[str | Encode, str, str]) -> dict[str, int]:
        """Lay out ``name``'s instructions: bytes as they are, or (kind, label, target) for a
        call/jmp/jmp8/je (or an encoder) to a function; returns the address after each
        labelled one."""
        addr, ends = self.at(name), {}
        encode = {"call": call, "jmp": jmp, "jmp8": jmp8, "je": je}
        for part in parts:
            if isinstance(part, tuple):
                kind, label, target = part
                part = (encode[kind] if isinstance(kind, str) else kind)(addr, self.at(target))
                ends[label] = addr + len(part)
            offset = addr - TEXT
            self.data[offset : offset + len(part)] = part
            addr += len(part)
        return ends

    def finder(self, bias: int = 0) -> TailCallFinder:
        table = SymbolTable(Symbol(self.at(n), SIZE, n) for n in self.names)
        image = CodeImage(TEXT, bytes(self.data), table, target_kind, self.arch, bias)
        return TailCallFinder([image])


PUSH_RBX = b"\x53"  # push %rbx
POP_RBX = b"\x5b"  # pop %rbx
RET = b"\xc3"  # ret
TEST = b"\x48\x85\xff"  # test %rdi,%rdi


def test_one_tail_call_gives_the_jumper_at_the_address_after_its_jump() -> None:
    """hrtimer_interrupt calls tick_program_event, which ends in ``jmp
    clockevents_program_event``: gdb shows tick_program_event at the address after the jmp."""
    code = Code("caller", "tick", "clockevents")
    ra = code.put("caller", PUSH_RBX, ("call", "ra", "tick"), POP_RBX, RET)["ra"]
    site = code.put("tick", PUSH_RBX, POP_RBX, ("jmp", "site", "clockevents"))["site"]
    code.put("clockevents", RET)
    finder = code.finder()
    chain = finder.between(ra, code.at("clockevents") + 0x10)
    assert chain.outcome is Outcome.FOUND and chain.pcs == (site,)
    # The frame's pc - 1 is inside the jmp, so it is named by the jumper, like a return address.
    found = finder.images[0].function(site - 1)
    assert found is not None and found[2] == "tick"


def test_a_call_to_the_callee_itself_adds_nothing() -> None:
    code = Code("caller", "callee")
    ra = code.put("caller", ("call", "ra", "callee"), RET)["ra"]
    assert code.finder().between(ra, code.at("callee") + 3).outcome is Outcome.DIRECT


def test_a_chain_of_tail_calls_comes_innermost_first() -> None:
    """caller -> a (jmp b) -> b (je c: a conditional tail call) -> c: gdb shows b, then a."""
    code = Code("caller", "a", "b", "c")
    ra = code.put("caller", ("call", "ra", "a"), RET)["ra"]
    a_site = code.put("a", TEST, ("jmp8", "site", "b"))["site"]
    b_site = code.put("b", TEST, ("je", "site", "c"), RET)["site"]
    code.put("c", RET)
    chain = code.finder().between(ra, code.at("c"))
    assert chain.pcs == (b_site, a_site)


def test_two_jumps_to_the_callee_share_no_end_and_give_nothing() -> None:
    """gdb's chain_candidate: the paths [site 1] and [site 2] share no caller and no callee."""
    code = Code("caller", "t", "f")
    ra = code.put("caller", ("call", "ra", "t"), RET)["ra"]
    code.put("t", TEST, ("je", "one", "f"), PUSH_RBX, POP_RBX, ("jmp", "two", "f"))
    code.put("f", RET)
    assert code.finder().between(ra, code.at("f")).outcome is Outcome.AMBIGUOUS


def test_paths_that_meet_keep_their_common_callee_frames() -> None:
    """t jumps to u or v, both jump to x, which jumps to f: the paths share only x's jump (the
    callees' end), so gdb shows x alone."""
    code = Code("caller", "t", "u", "v", "x", "f")
    ra = code.put("caller", ("call", "ra", "t"), RET)["ra"]
    code.put("t", TEST, ("je", "1", "u"), ("jmp", "2", "v"))
    code.put("u", ("jmp", "site", "x"))
    code.put("v", PUSH_RBX, POP_RBX, ("jmp", "site", "x"))
    x_site = code.put("x", TEST, ("jmp", "site", "f"))["site"]
    code.put("f", RET)
    chain = code.finder().between(ra, code.at("f") + 1)
    assert chain.outcome is Outcome.FOUND and chain.pcs == (x_site,)


def test_a_jump_gdb_cannot_follow_ends_the_search() -> None:
    """An indirect tail call (``jmp __x86_indirect_thunk_rax``, or through a register) in a
    function on the way: gdb's DWARF has no target for it and it gives up; so does the search.
    A jump to a static-call trampoline (no DWARF) too."""
    for tail in (
        ("jmp", "x", "__x86_indirect_thunk_rax"),
        b"\xff\xe0",  # jmp *%rax
        ("jmp", "x", "__SCT__tp_func_x"),
    ):
        code = Code("caller", "t", "f", "__x86_indirect_thunk_rax", "__SCT__tp_func_x")
        ra = code.put("caller", ("call", "ra", "t"), RET)["ra"]
        code.put("t", TEST, ("je", "site", "f"), tail)
        code.put("f", RET)
        assert code.finder().between(ra, code.at("f")).outcome is Outcome.GAVE_UP, tail


def test_return_thunks_are_returns_not_tail_calls() -> None:
    """``jmp __x86_return_thunk`` is a ``ret`` (rethunk kernels): t's one tail call stays one."""
    code = Code("caller", "t", "f", "__x86_return_thunk")
    ra = code.put("caller", ("call", "ra", "t"), RET)["ra"]
    site = code.put("t", TEST, ("je", "site", "f"), ("jmp", "ret", "__x86_return_thunk"))
    code.put("f", RET)
    assert code.finder().between(ra, code.at("f")).pcs == (site["site"],)


def test_calls_with_no_known_target_add_nothing() -> None:
    """A call through a retpoline thunk, a static call, an indirect call, no call at all."""
    code = Code("caller", "f", "__x86_indirect_thunk_rax", "__SCT__foo")
    ends = code.put(
        "caller",
        ("call", "thunk", "__x86_indirect_thunk_rax"),
        ("call", "static", "__SCT__foo"),
        b"\xff\xd0",  # call *%rax
        b"\x90\x90\x90\x90\x90",  # 5 nops: a return address after no call
    )
    finder = code.finder()
    after_indirect = ends["static"] + 2
    for ra in (ends["thunk"], ends["static"], after_indirect, after_indirect + 5):
        assert finder.between(ra, code.at("f")).outcome is Outcome.UNKNOWN_CALL, hex(ra)


def test_a_cold_part_belongs_to_its_function() -> None:
    """gcc's ``t.cold``: t's jump to it is no tail call; its jump to f is t's, and a callee
    in ``f.cold`` is f."""
    code = Code("caller", "t", "f", "t.cold", "f.cold")
    ra = code.put("caller", ("call", "ra", "t"), RET)["ra"]
    code.put("t", TEST, ("je", "cold", "t.cold"), RET)
    site = code.put("t.cold", PUSH_RBX, POP_RBX, ("jmp", "site", "f"))["site"]
    code.put("f", RET)
    assert code.finder().between(ra, code.at("f.cold") + 2).pcs == (site,)


def test_a_cold_part_is_matched_only_to_a_name_one_function_has() -> None:
    """``t.cold.1`` (gcc numbers a second part) is t's; ``f.cold`` beside two functions named f
    (two static functions of one name) is nobody's but its own."""
    names = ["t", "f", "f", "t.cold.1", "f.cold", "g"]
    at = [TEXT + SIZE * i for i in range(len(names))]
    table = SymbolTable(Symbol(addr, SIZE, name) for addr, name in zip(at, names, strict=True))
    image = CodeImage(TEXT, b"\xcc" * SIZE * len(names), table, target_kind, X86_64)
    t, f, other_f, t_cold, f_cold, g = at
    assert image.owner(t_cold) == t
    assert image.parts(t) == [t, t_cold]
    assert image.owner(f_cold) == f_cold
    assert image.parts(f) == [f] and image.parts(other_f) == [other_f]
    assert image.owner(g) == g


def test_runtime_addresses_under_a_slide() -> None:
    slide = 0x3A0_0000
    code = Code("caller", "t", "f")
    ra = code.put("caller", ("call", "ra", "t"), RET)["ra"]
    site = code.put("t", PUSH_RBX, POP_RBX, ("jmp", "site", "f"))["site"]
    chain = code.finder(bias=slide).between(ra + slide, code.at("f") + slide)
    assert chain.pcs == (site + slide,)


def test_a_walked_stack_gets_its_tail_call_frames() -> None:
    """leaf f (interrupted) <- t's jump <- caller (return address); and above an interrupted
    caller (a trap frame's pc) nothing is searched: it called nothing."""
    code = Code("caller", "t", "f", "outer")
    ra = code.put("caller", ("call", "ra", "t"), RET)["ra"]
    site = code.put("t", PUSH_RBX, POP_RBX, ("jmp", "site", "f"))["site"]
    code.put("f", RET)
    finder = code.finder()
    leaf = code.at("f")
    pcs, exact, chains = with_tail_calls(
        (leaf, ra, code.at("outer") + 4), (True, False, True), finder
    )
    assert pcs == (leaf, site, ra, code.at("outer") + 4)
    assert exact == (True, False, False, True)
    assert [c.outcome if c else None for c in chains] == [Outcome.FOUND, None, None]


ENDBR64 = b"\xf3\x0f\x1e\xfa"  # endbr64
NOP5 = b"\x0f\x1f\x44\x00\x00"  # nopl 0x0(%rax,%rax,1): ftrace's


def words(*insns: int) -> bytes:
    return b"".join(i.to_bytes(4, "little") for i in insns)


def a64(opcode: int) -> Encode:
    """An aarch64 B/BL-like instruction: ``opcode`` and a 26-bit word offset."""
    return lambda at, to: (opcode | (to - at) >> 2 & 0x3FF_FFFF).to_bytes(4, "little")


def rv_jal(rd: int) -> Encode:
    """riscv64 ``jal rd, offset`` (rd 0: ``j``, 1: a call)."""

    def encode(at: int, to: int) -> bytes:
        imm = (to - at) & 0x1F_FFFF
        insn = (imm >> 20 << 31 | (imm >> 1 & 0x3FF) << 21 | (imm >> 11 & 1) << 20
                | (imm >> 12 & 0xFF) << 12 | rd << 7 | 0x6F)  # fmt: skip
        return insn.to_bytes(4, "little")

    return encode


@dataclass(frozen=True)
class Isa:
    """What the tests below write in each instruction set."""

    arch: InstructionSet
    fill: bytes  # a trap: what follows a function's code
    call: Encode
    jump: Encode  # a direct unconditional jump
    pad: bytes  # a landing pad or no-op
    body: bytes  # an instruction that does something
    ret: bytes


ISAS = {
    "x86_64": Isa(X86_64, b"\xcc", call, jmp, ENDBR64 + NOP5, TEST + PUSH_RBX + POP_RBX, RET),
    # brk #0; bl; b; bti c; mov x8, x0; ret
    "aarch64": Isa(AARCH64, words(0xD4200000), a64(0x9400_0000), a64(0x1400_0000),
                   words(0xD503245F), words(0xAA0003E8), words(0xD65F03C0)),
    # ebreak; jal ra; j; nop; addi a0, a0, 1; ret
    "riscv64": Isa(RISCV64, words(0x00100073), rv_jal(1), rv_jal(0), words(0x13),
                     words(0x00150513), words(0x8067)),
}  # fmt: skip


@pytest.mark.parametrize("isa", ISAS.values(), ids=ISAS.keys())
def test_a_function_that_only_jumps_out_is_crossed_never_made_a_frame(isa: Isa) -> None:
    """arm64's memset is ``bti c; b __pi_memset_generic``, then code only boot-time patching
    makes its own (issue 35): gdb has no frame for it, called or jumped through, and its
    frame would name an instruction it never ran; a jumper that does something before its
    jump stays one."""
    code = Code("caller", "other", "t", "memset", "f", arch=isa.arch, fill=isa.fill)
    ra = code.put("caller", (isa.call, "ra", "memset"), isa.ret)["ra"]
    code.put("memset", isa.pad, (isa.jump, "site", "f"), isa.body, (isa.jump, "x", "caller"))
    chain = code.finder().between(ra, code.at("f"))
    assert chain.outcome is Outcome.FOUND and chain.pcs == ()
    # Through it: other -> t (its frame) -> memset (none) -> f.
    ra = code.put("other", (isa.call, "ra", "t"), isa.ret)["ra"]
    site = code.put("t", isa.body, (isa.jump, "site", "memset"))["site"]
    assert code.finder().between(ra, code.at("f")).pcs == (site,)


@pytest.mark.parametrize("isa", ISAS.values(), ids=ISAS.keys())
def test_a_first_jump_into_itself_leaves_the_function_whole(isa: Isa) -> None:
    """A static key's or an alternative's jump at a function's start (481 functions of arm64's
    7.2 Image begin with one) passes over code the function has: its tail jump further on
    makes it a frame."""
    code = Code("caller", "t", "f", arch=isa.arch, fill=isa.fill)
    ra = code.put("caller", (isa.call, "ra", "t"), isa.ret)["ra"]
    t = code.at("t")
    skip = isa.jump(t, t + len(isa.jump(0, 0)) + len(isa.body))
    site = code.put("t", skip, isa.body, (isa.jump, "site", "f"))["site"]
    assert code.finder().between(ra, code.at("f")).pcs == (site,)


def test_the_lone_jump_is_read_on_every_instruction_set() -> None:
    """(address after, target) of the jump a function begins with, after landing pads and
    no-ops; None for anything else first."""
    # bti c; b .+0x40; then code that is not reached from the start
    assert AARCH64.lone_jump(words(0xD503245F, 0x14000010, 0xAA0003E8), 0x1000) == (0x1008, 0x1044)
    assert AARCH64.lone_jump(words(0x17FFFFFF), 0x1000) == (0x1004, 0xFFC)  # b .-4
    assert AARCH64.lone_jump(words(0xAA0003E8, 0x14000010), 0) is None  # mov x8, x0; b
    assert AARCH64.lone_jump(words(0xD503245F, 0x94000010), 0) is None  # bti c; bl
    assert AARCH64.lone_jump(words(0xD503245F, 0xD61F0200), 0) is None  # bti c; br x16
    assert AARCH64.lone_jump(words(0xD503245F), 0) is None
    # nop; c.nop; j .; then c.j .; addi a0, a0, 1 first; jal ra (a call)
    assert RISCV64.lone_jump(words(0x13) + b"\x01\x00" + words(0x6F), 0x1000) == (0x100A, 0x1006)
    assert RISCV64.lone_jump(b"\x01\xa0", 0x1000) == (0x1002, 0x1000)
    assert RISCV64.lone_jump(words(0x00150513, 0x6F), 0) is None
    assert RISCV64.lone_jump(words(0x13, 0xEF), 0) is None
    assert X86_64.lone_jump(ENDBR64 + NOP5 + jmp(9, 0x40) + b"\xcc", 0) == (14, 0x40)
    assert X86_64.lone_jump(jmp8(0x10, 0x20), 0x10) == (0x12, 0x20)
    assert X86_64.lone_jump(jmp8(0, 6), 0) == (2, 6)  # capstone writes "jmp 6"
    assert X86_64.lone_jump(PUSH_RBX + jmp(1, 0x40), 0) is None
    assert X86_64.lone_jump(ENDBR64 + b"\xff\xe0", 0) is None  # jmp *%rax
    assert X86_64.lone_jump(ENDBR64 + call(4, 0x40), 0) is None


def test_linux_names() -> None:
    kinds = {
        name: target_kind(name).value
        for name in (
            "__x86_indirect_thunk_array",
            "__x86_indirect_call_thunk_r11",
            "__x86_return_thunk",
            "srso_return_thunk",
            "entry_untrain_ret",
            "__SCT__might_resched",
            "schedule",
            "__pi___x86_indirect_thunk_rax",
            "__pi___x86_return_thunk",
        )
    }
    assert kinds == {
        "__x86_indirect_thunk_array": "indirect",
        "__x86_indirect_call_thunk_r11": "indirect",
        "__x86_return_thunk": "return",
        "srso_return_thunk": "return",
        "entry_untrain_ret": "return",
        "__SCT__might_resched": "opaque",
        "__pi___x86_indirect_thunk_rax": "indirect",  # 6.16 on: the startup code's alias
        "__pi___x86_return_thunk": "return",
        "schedule": "function",
    }


def test_the_unwinder_names_the_tail_call_frames_of_a_module_that_gives_its_code() -> None:
    """Unwinder.resolve puts the jumper between the callee and its caller, named as a caller
    (its pc - 1 is in the jump) and marked as put back; a module without code gets none."""
    code = Code("caller", "tick", "clockevents")
    ra = code.put("caller", PUSH_RBX, ("call", "ra", "tick"), POP_RBX, RET)["ra"]
    code.put("tick", PUSH_RBX, POP_RBX, ("jmp", "site", "clockevents"))
    code.put("clockevents", RET)
    (image,) = code.finder().images
    mapping = Mapping("vmlinux", TEXT, TEXT + len(code.data), True)
    raw = RawStack((code.at("clockevents") + 1, ra), StopReason.END, (True, False))
    with_code = AddressSpace([Module(mapping, symbols=image.functions, calls=image)])
    stack = Unwinder(X86_64).resolve(raw, with_code)
    assert [(f.symbol, f.kernel, f.tail_call) for f in stack.frames] == [
        ("clockevents", True, False), ("tick", True, True), ("caller", True, False),
    ]  # fmt: skip
    without = AddressSpace([Module(mapping, symbols=image.functions)])
    assert [f.symbol for f in Unwinder(X86_64).resolve(raw, without).frames] == [
        "clockevents",
        "caller",
    ]
