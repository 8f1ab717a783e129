"""Code with neither CFI nor frame pointers, followed to its return or from its function's
start (unwind/scan.py, arch/x86scan.py): a real gcc build (tests/data/nocfi.c,
-fno-asynchronous-unwind-tables -fomit-frame-pointer -O2, stripped) walked from the stack it
dumps of itself, checked against the call chain it has by construction (named from the
unstripped build); and hand-assembled code for what the scan must refuse."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
from fakes import make_module
from test_unwind_chain import memory, regs

from qmpprof.arch.x86 import I386, X86_64
from qmpprof.elf.image import ElfImage
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.model import StopReason
from qmpprof.pagecache import PAGE, PageCache, page_of
from qmpprof.unwind.chain import AddressSpace, Module, Unwinder, Via

DATA = Path(__file__).parents[1] / "data"
FLAGS = ["-O2", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables", "-fomit-frame-pointer"]


@pytest.fixture(scope="module")
def nocfi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The program with its symbols, and the same bytes stripped."""
    out = tmp_path_factory.mktemp("nocfi")
    full, stripped = out / "nocfi", out / "nocfi.stripped"
    subprocess.run(["gcc", *FLAGS, "-no-pie", "-o", str(full), str(DATA / "nocfi.c")], check=True)
    subprocess.run(["strip", "-o", str(stripped), str(full)], check=True)
    return full, stripped


def dumped_stack(program: Path) -> tuple[int, int, int, PageCache]:
    """pc, rsp, rbp of the program's leaf and a page cache of the 1 KiB of stack it wrote."""
    out = subprocess.run([str(program)], capture_output=True, check=False).stdout
    pc, sp, fp = struct.unpack_from("<3Q", out)
    stack = out[24:]
    assert len(stack) == 1024
    cache = PageCache()
    for base in range(page_of(sp), sp + len(stack), PAGE):
        page = bytearray(PAGE)
        lo, hi = max(base, sp), min(base + PAGE, sp + len(stack))
        page[lo - base : hi - base] = stack[lo - sp : hi - sp]
        cache.pages[base] = bytes(page)
    return pc, sp, fp, cache


def test_stripped_code_with_no_cfi_walks_to_main(nocfi: tuple[Path, Path]) -> None:
    full, stripped = nocfi
    image = ElfImage.load(stripped)
    assert not len(image.symbols)  # nothing but the code to go by
    names = ElfImage.load(full).symbols
    pc, sp, fp, cache = dumped_stack(stripped)
    space = AddressSpace([Module.from_image(image, kernel=False)])
    raw = Unwinder(X86_64).unwind(regs(pc, sp, fp), cache, space)
    found = [names.lookup(p if i == 0 else p - 1) for i, p in enumerate(raw.pcs[:5])]
    assert [hit and hit[0] for hit in found] == ["leaf", "mid", "never_returns", "outer", "main"]
    assert raw.via[:5] == (Via.REGS, Via.SCAN, Via.SCAN, Via.SCAN, Via.SCAN)
    # main returns into libc, which this space does not hold: the scan cannot check that
    # return address and leaves the frame to frame pointers (what they find depends on the
    # libc's registers, the address layout: not asserted)


def test_a_return_address_not_after_a_call_stops_the_walk(nocfi: tuple[Path, Path]) -> None:
    _, stripped = nocfi
    image = ElfImage.load(stripped)
    pc, sp, fp, cache = dumped_stack(stripped)
    space = AddressSpace([Module.from_image(image, kernel=False)])
    unwinder = Unwinder(X86_64)
    ra_slot = sp + 0x28  # leaf: push rbx, sub rsp 0x20 (tests/data/nocfi.c's build)
    assert len(unwinder.unwind(regs(pc, sp, fp), cache, space).pcs) >= 4
    page = bytearray(cache.pages[page_of(ra_slot)] or b"")
    struct.pack_into("<Q", page, ra_slot - page_of(ra_slot), pc)  # no call right before it
    cache.pages[page_of(ra_slot)] = bytes(page)
    raw = unwinder.unwind(regs(pc, sp, fp), cache, space)
    assert raw.pcs == (pc,)
    assert raw.stop is StopReason.NO_CFI


CODE_ADDR = 0x1000
STACK = 0x7000_0000


def scan_module(code: bytes) -> AddressSpace:
    def starts() -> list[int]:
        return X86_64.function_starts(code, CODE_ADDR, [])

    return AddressSpace(
        [make_module("prog", CODE_ADDR, CODE_ADDR + 0x1000, kernel=False, code=code,
                     code_addr=CODE_ADDR, starts=starts)]
    )  # fmt: skip


CALLER = bytes.fromhex("e8 00 00 00 00")  # at 0x1800: call; its return address is 0x1805


@pytest.mark.parametrize(
    ("body", "ra_slot", "via"),
    [
        # push rbx; sub rsp, 0x10; add rsp, 0x10; pop rbx; ret: the pc is after the sub
        (bytes.fromhex("53 48 83 ec 10 48 83 c4 10 5b c3"), STACK + 0x18, Via.SCAN),
        # jne over a block that calls abort (e8, then int3 padding), the fall-through returns
        (bytes.fromhex("53 48 83 ec 10 75 06 e8 00 00 00 00 cc 48 83 c4 10 5b c3"),
         STACK + 0x18, Via.SCAN),
        # and rsp, -16 (stack realignment): not modelled, frame pointers then (rbp 0: the end)
        (bytes.fromhex("53 48 83 ec 10 48 83 e4 f0 5b c3"), None, Via.REGS),
        # mov ebp, eax (all of rbp written) then leave: the frame pointer is not known
        (bytes.fromhex("53 48 83 ec 10 89 c5 c9 c3"), None, Via.REGS),
        # jmp rax (a switch): not modelled either
        (bytes.fromhex("53 48 83 ec 10 ff e0"), None, Via.REGS),
    ],
)  # fmt: skip
def test_scan_cases(body: bytes, ra_slot: int | None, via: Via) -> None:
    code = bytearray(b"\xcc" * 0x1000)
    code[: len(body)] = body
    code[0x800 : 0x800 + len(CALLER)] = CALLER
    pc = CODE_ADDR + 5  # after push rbx; sub rsp, 0x10
    words = {} if ra_slot is None else {ra_slot: 0x1805}
    raw = Unwinder(X86_64).unwind(regs(pc, STACK), memory(words), scan_module(bytes(code)))
    if ra_slot is None:
        assert raw.pcs == (pc,)
    else:
        assert raw.pcs[:2] == (pc, 0x1805)
    assert raw.via[-1] is via


def call(at: int, target: int) -> bytes:
    """A direct call at ``at`` to ``target``."""
    return b"\xe8" + struct.pack("<i", target - (at + 5))


@pytest.mark.parametrize(("called", "found"), [(0x1000, True), (0x1100, False)])
def test_a_function_that_never_returns_is_walked_from_its_start(called: int, found: bool) -> None:
    """push rbx; sub rsp, 0x10; call a function that does not return (int3 after it): no path
    reaches a return, so the scan goes from the start that a direct call at 0x1900 names. The
    return address on the stack must come back from a call of that start: one of another start
    (0x1100) is a wrong guess, and the walk stops there."""
    code = bytearray(b"\xcc" * 0x1000)
    body = bytes.fromhex("53 48 83 ec 10") + call(0x1005, 0x1F00)
    code[: len(body)] = body
    code[0x800:0x805] = call(0x1800, called)  # the caller on the stack
    code[0x900:0x905] = call(0x1900, 0x1000)  # another caller of the function: its start
    pc = CODE_ADDR + 5
    words = {STACK + 0x18: 0x1805}
    raw = Unwinder(X86_64).unwind(regs(pc, STACK), memory(words), scan_module(bytes(code)))
    if found:
        assert raw.pcs[:2] == (pc, 0x1805)
        assert raw.via[1] is Via.SCAN
    else:
        assert raw.pcs == (pc,)
        assert raw.stop is StopReason.NO_CFI


def test_a_caller_of_a_function_that_does_not_return_is_walked_from_its_start() -> None:
    """F (0x1000: push rbx; sub rsp, 0x10; call 0x1f00) ends in a call that does not return,
    so its return address 0x100a is where G starts (sub rsp, 0x28; add rsp, 0x28; ret): the
    code there is G's, not F's; F's caller is found from F's start."""
    code = bytearray(b"\xcc" * 0x1000)
    body = bytes.fromhex("53 48 83 ec 10") + call(0x1005, 0x1F00)
    code[: len(body)] = body
    code[0xA : 0xA + 9] = bytes.fromhex("48 83 ec 28 48 83 c4 28 c3")  # G
    code[0xF00] = 0xC3  # the leaf: ret
    code[0x800:0x805] = call(0x1800, 0x1000)  # F's caller, on the stack
    code[0xA00:0xA05] = call(0x1A00, 0x100A)  # G's caller: G's start
    words = {STACK: 0x100A, STACK + 8 + 0x18: 0x1805}
    raw = Unwinder(X86_64).unwind(regs(0x1F00, STACK), memory(words), scan_module(bytes(code)))
    assert raw.pcs[:3] == (0x1F00, 0x100A, 0x1805)


def interrupt_code() -> bytes:
    """An interrupt entry with no CFI, as a small kernel has it: the stub at 0x1000 (push 0;
    push 0x20; jmp 0x1010), the common path at 0x1010 (push rax; mov rdi, rsp; call the handler
    at 0x1f00; pop rax; add rsp, 0x10; iretq), a function at 0x1100 with no frame (sub rsp, 8;
    add rsp, 8; ret) called from 0x1800, and a decoy call at 0x1900."""
    code = bytearray(b"\xcc" * 0x1000)
    code[0:6] = bytes.fromhex("6a 00 6a 20 eb 0a")
    common = bytes.fromhex("50 48 89 e7") + call(0x1014, 0x1F00)
    common += bytes.fromhex("58 48 83 c4 10 48 cf")
    code[0x10 : 0x10 + len(common)] = common
    code[0x100:0x109] = bytes.fromhex("48 83 ec 08 48 83 c4 08 c3")
    code[0x800:0x805] = call(0x1800, 0x1100)
    code[0x900:0x905] = call(0x1900, 0x1100)
    code[0xF00] = 0xC3
    return bytes(code)


@pytest.mark.parametrize("caught", ["stub entry", "handler"])
def test_an_interrupt_entry_hands_over_to_the_interrupted_code(caught: str) -> None:
    """The common path followed to its ``iretq``: the frame the CPU pushed gives the interrupted
    pc (exact) and stack pointer, so the interrupted frameless function finds its caller at
    0x1805, not the frame pointer's decoy 0x1905. Caught at the stub's first instruction,
    prologue analysis alone would take the stub for a function called from the interrupted pc."""
    sp2, fp = STACK + 0x800, STACK + 0x900  # the interrupted stack; a frame pointer's decoy
    frame = STACK + (0 if caught == "stub entry" else 8 + 8 + 0x10)
    words = {frame: 0x1104, frame + 8: 0x10, frame + 16: 0x202, frame + 24: sp2, frame + 32: 0x18}
    words |= {sp2 + 8: 0x1805, fp: 0, fp + 8: 0x1905}
    expected: tuple[int, ...] = (0x1000, 0x1104, 0x1805)
    if caught == "handler":  # the handler's ret; its caller the common path
        expected, words[STACK] = (0x1F00, 0x1019, 0x1104, 0x1805), 0x1019
    named = SymbolTable([Symbol(0x1000, 6, "isr_32"), Symbol(0x1010, 0x20, "isr_common")])
    module = make_module(
        "kernel", CODE_ADDR, CODE_ADDR + 0x1000, kernel=False, code=interrupt_code(),
        code_addr=CODE_ADDR, symbols=named,
    )  # fmt: skip
    raw = Unwinder(X86_64).unwind(
        regs(expected[0], STACK, fp), memory(words), AddressSpace([module])
    )
    assert raw.pcs[: len(expected)] == expected, raw
    at = expected.index(0x1104)
    assert raw.exact[at] and not raw.exact[at + 1]
    assert raw.via[at] is Via.SCAN


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ((0xC010_034A, 0x08, 0x202), (0xC010_034A, 0x1000 + 12)),  # ring 0: no SS:ESP pushed
        ((0x0804_8000, 0x1B, 0x202, 0xBFFF_F000), (0x0804_8000, 0xBFFF_F000)),  # from ring 3
        ((0xC010_034A, 0x08, 0x200), None),  # FLAGS bit 1 clear: not a trap frame
        ((0xC010_034A, 0x1_0008, 0x202), None),  # CS wider than a selector
    ],
)
def test_i386_trap_frames_as_iret_pops_them(
    words: tuple[int, ...], expected: tuple[int, int] | None
) -> None:
    stack = {0x1000 + 4 * i: word for i, word in enumerate(words)}
    assert I386.trap_return(0x1000, stack.get) == expected


# A teaching kernel's trap entry and exit (fixtures/hobby/entry.S): from alltraps (the vector
# pushed two words) push %ds, %es, %fs, %gs; pushal; mov $0x10, %ax; push %esp; call trap;
# add $4, %esp; then trapret: popal; pop %gs, %fs, %es, %ds; add $8, %esp; iret.
ALLTRAPS = bytes.fromhex("1e 06 0f a0 0f a8 60 66 b8 10 00 54 e8 00 00 00 00 83 c4 04")
TRAPRET = bytes.fromhex("61 0f a9 0f a1 07 1f 83 c4 08 cf")


@pytest.mark.parametrize(
    ("pc", "frame", "fp"),
    [
        (0, 8, None),  # alltraps's first instruction: trapno and err above
        (6, 24, None),  # at pushal: the four segments pushed too
        (7, 56, 8),  # after pushal: ebp saved two words above the lowest
        (len(ALLTRAPS), 56, 8),  # trapret's popal
        (len(ALLTRAPS) + 1, 24, None),  # after it: ebp is the interrupted code's again
    ],
)
def test_pushal_and_popal_move_the_stack_eight_words(pc: int, frame: int, fp: int | None) -> None:
    """The scan to the iret finds the frame the CPU pushed, wherever the stack is in between
    (the call to the handler, e8 with displacement 0 here, stepped over)."""
    rule = I386.return_scan(ALLTRAPS + TRAPRET, 0x1000, 0x1000 + pc)
    assert rule is not None and rule.trap
    assert (rule.ra_offset, rule.fp_offset) == (frame, fp)
