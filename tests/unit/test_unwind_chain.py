"""The stack walker over hand-built stacks in a fake PageCache: CFI, frame pointers, prologue
analysis, kernel->user trap frames, and every way a walk ends."""

from __future__ import annotations

import struct

import pytest
from fakes import make_module, x86
from test_cfi import PLT_EXPR, cie, fde, sleb, uleb

from qmpprof.arch.x86 import I386, X86_64
from qmpprof.dwarf.cfi import CfiTable
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.model import Mapping, Registers, StopReason
from qmpprof.pagecache import PAGE, PageCache, PageMissing, page_of
from qmpprof.unwind.chain import AddressSpace, Module, RawStack, Unwinder, Via

RSP, RBX, RIP = 7, 3, 16
KBASE = 0xFFFF_FFFF_8000_0000
KSTACK = 0xFFFF_C900_0000_2000
USTACK = 0x7FF0_0000
STACK = 0x7000_0000


def memory(words: dict[int, int], unmapped: tuple[int, ...] = ()) -> PageCache:
    """A page cache holding ``words`` (8-byte values); other pages of their stacks read as 0."""
    cache = PageCache()
    pages: dict[int, bytearray] = {}
    for addr, value in words.items():
        page = pages.setdefault(page_of(addr), bytearray(PAGE))
        struct.pack_into("<Q", page, addr - page_of(addr), value)
    for base, page in pages.items():
        cache.pages[base] = bytes(page)
    for base in unmapped:
        cache.pages[base] = None
    return cache


def regs(rip: int, rsp: int, rbp: int = 0, cpl: int = 3) -> Registers:
    return x86(0, rip, rsp, rbp, cpl=cpl)


# --- CFI ---------------------------------------------------------------------------------


def cfi_module() -> Module:
    data = cie()
    a_insns = bytes([0x40 | 1]) + b"\x0e" + uleb(16) + bytes([0x80 | RBX]) + uleb(2)  # push rbx
    for begin, insns in (
        (0x1000, a_insns),  # A: after 1 byte, CFA = rsp+16, rbx at CFA-16
        (0x1100, b"\x0e" + uleb(32)),  # B: CFA = rsp+32 throughout
        (0x1200, b"\x07" + uleb(RIP)),  # C: the outermost frame, return address undefined
        (0x1300, b"\x0e" + uleb(0)),  # D: a broken row whose CFA is the stack pointer itself
    ):
        data += fde(0, len(data), begin, 0x100, insns)
    table = CfiTable.parse(data, 0x500)
    return make_module("prog", 0x1000, 0x2000, kernel=False, cfi=table)


def test_cfi_walk_to_the_outermost_frame() -> None:
    space = AddressSpace([cfi_module()])
    mem = memory({STACK + 8: 0x1150, STACK + 16 + 24: 0x1250})
    raw = Unwinder(X86_64).unwind(regs(0x1010, STACK), mem, space)
    assert raw.pcs == (0x1010, 0x1150, 0x1250)
    assert raw.stop is StopReason.END
    assert raw.via == (Via.REGS, Via.CFI, Via.CFI)
    assert raw.exact == (True, False, False)


def test_cfi_row_at_function_entry_uses_the_cie_rule() -> None:
    space = AddressSpace([cfi_module()])
    mem = memory({STACK: 0x1150, STACK + 8 + 24: 0x1250})
    raw = Unwinder(X86_64).unwind(regs(0x1000, STACK), mem, space)
    assert raw.pcs == (0x1000, 0x1150, 0x1250)


def test_stack_pointer_that_does_not_grow_is_a_loop() -> None:
    space = AddressSpace([cfi_module()])
    raw = Unwinder(X86_64).unwind(regs(0x1310, STACK), memory({STACK - 8: 0x1310}), space)
    assert raw.pcs == (0x1310,) and raw.stop is StopReason.LOOP


def test_unmapped_stack_page_truncates() -> None:
    space = AddressSpace([cfi_module()])
    sp = STACK + PAGE - 16  # A's frame fits in this page, B's return address is on the next
    mem = memory({sp + 8: 0x1150}, unmapped=(STACK + PAGE,))
    raw = Unwinder(X86_64).unwind(regs(0x1010, sp), mem, space)
    assert raw.pcs == (0x1010, 0x1150) and raw.stop is StopReason.READ_FAILED


def test_page_missing_propagates_and_a_rerun_succeeds() -> None:
    space = AddressSpace([cfi_module()])
    mem = memory({STACK + 8: 0x1150})
    del mem.pages[page_of(STACK)]
    unwinder = Unwinder(X86_64)
    with pytest.raises(PageMissing) as missing:
        unwinder.unwind(regs(0x1010, STACK), mem, space)
    assert page_of(missing.value.addr) == page_of(STACK)
    mem.pages.update(memory({STACK + 8: 0x1150, STACK + 16 + 24: 0x1250}).pages)
    assert unwinder.unwind(regs(0x1010, STACK), mem, space).pcs == (0x1010, 0x1150, 0x1250)


# --- Frame pointers ----------------------------------------------------------------------


def fp_chain(depth: int, outer_rbp: int = 0) -> tuple[dict[int, int], int]:
    """``depth`` frames linked by saved RBPs, 32 bytes apart; returns words and the leaf RBP."""
    words: dict[int, int] = {}
    for i in range(depth):
        rbp = STACK + 16 + 32 * i
        words[rbp] = rbp + 32 if i < depth - 1 else outer_rbp  # saved rbp
        words[rbp + 8] = 0x400000 + 0x100 * (i + 1)  # return address
    return words, STACK + 16


def test_frame_pointer_walk_ends_at_a_zero_rbp() -> None:
    words, rbp = fp_chain(3)
    raw = Unwinder(X86_64).unwind(regs(0x400010, STACK, rbp), memory(words), AddressSpace([]))
    assert raw.pcs == (0x400010, 0x400100, 0x400200, 0x400300)
    assert raw.stop is StopReason.END
    assert raw.via[1:] == (Via.FRAME_POINTER,) * 3


def test_depth_cap() -> None:
    words, rbp = fp_chain(50)
    raw = Unwinder(X86_64, max_depth=10).unwind(
        regs(0x400010, STACK, rbp), memory(words), AddressSpace([])
    )
    assert len(raw.pcs) == 10 and raw.stop is StopReason.DEPTH


def test_rbp_below_the_stack_pointer_is_not_a_frame_pointer() -> None:
    raw = Unwinder(X86_64).unwind(regs(0x400010, STACK, STACK - 64), memory({}), AddressSpace([]))
    assert raw.pcs == (0x400010,) and raw.stop is StopReason.NO_CFI


def test_non_canonical_return_address_is_bad() -> None:
    words = {STACK + 16: 0, STACK + 24: 0x0000_9000_0000_0000}
    raw = Unwinder(X86_64).unwind(
        regs(0x400010, STACK, STACK + 16), memory(words), AddressSpace([])
    )
    assert raw.stop is StopReason.BAD_RETURN


# --- Prologue analysis -------------------------------------------------------------------

CODE = bytes.fromhex(
    "55"  # 0x1000 P: push rbp
    "4889e5"  # 0x1001 mov rbp, rsp
    "4883ec10"  # 0x1004 sub rsp, 0x10
    "90"  # 0x1008 nop
    "c9"  # 0x1009 leave
    "c3"  # 0x100a ret
    "9090909090"  # 0x100b padding
    "53"  # 0x1010 L: push rbx  (a leaf without a frame pointer)
    "4883ec08"  # 0x1011 sub rsp, 8
    "90"  # 0x1015 nop
    "4883c408"  # 0x1016 add rsp, 8
    "5b"  # 0x101a pop rbx
    "c3"  # 0x101b ret
)
CALLER = 0x1150  # a return address into M, which has a frame-pointer frame
OUTER = STACK + 0x800  # M's frame: saved rbp 0 and return address 0 end the walk


def prologue_module(with_symbols: bool = True) -> Module:
    symbols = SymbolTable([Symbol(0x1000, 0xB, "P"), Symbol(0x1010, 0xC, "L")])
    return make_module(
        "prog", 0x1000, 0x2000, kernel=False,
        symbols=symbols if with_symbols else None, code=CODE, code_addr=0x1000,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("pc", "ra_slot", "via"),
    [
        (0x1000, STACK, Via.PROLOGUE),  # before push rbp: return address at [rsp]
        (0x1001, STACK + 8, Via.PROLOGUE),  # after push rbp, before mov rbp, rsp
        (0x1008, None, Via.FRAME_POINTER),  # frame set up: RBP is right
        (0x100A, STACK, Via.PROLOGUE),  # at ret after leave
        (0x1015, STACK + 16, Via.PROLOGUE),  # leaf: push rbx; sub rsp, 8
        (0x101A, STACK + 8, Via.PROLOGUE),  # leaf epilogue: after add rsp, 8
    ],
)
def test_prologue_cases(pc: int, ra_slot: int | None, via: Via) -> None:
    words = {OUTER: 0, OUTER + 8: 0}
    rbp = OUTER
    if ra_slot is None:  # P's frame: rbp points at [saved rbp, return address]
        rbp = STACK + 0x10
        words |= {rbp: OUTER, rbp + 8: CALLER}
    else:
        words[ra_slot] = CALLER
        if pc == 0x1001:
            words[STACK] = OUTER  # the pushed rbp
    raw = Unwinder(X86_64).unwind(
        regs(pc, STACK, rbp), memory(words), AddressSpace([prologue_module()])
    )
    assert raw.pcs == (pc, CALLER)
    assert raw.via[1] is via
    assert raw.stop is StopReason.END


@pytest.mark.parametrize(("pc", "ra_slot"), [(0x1000, STACK), (0x1001, STACK + 8), (0x100A, STACK)])
def test_prologue_without_symbols(pc: int, ra_slot: int) -> None:
    words = {OUTER: 0, OUTER + 8: 0, ra_slot: CALLER, STACK: OUTER} | {ra_slot: CALLER}
    space = AddressSpace([prologue_module(with_symbols=False)])
    raw = Unwinder(X86_64).unwind(regs(pc, STACK, OUTER), memory(words), space)
    assert raw.pcs == (pc, CALLER) and raw.via[1] is Via.PROLOGUE


# --- Kernel -> user trap frames ----------------------------------------------------------


def kernel_module(signal: bool) -> Module:
    data = cie()  # offset 0: ordinary functions
    stub_cie = len(data)
    data += cie(aug=b"zRS" if signal else b"zR")
    # The interrupt stub: the CPU pushed SS, RSP, RFLAGS, CS, RIP; CFA = rsp + 40,
    # user RIP at CFA-40, user RSP at CFA-16.
    stub = (
        b"\x0e" + uleb(40)  # def_cfa_offset 40
        + bytes([0x80 | RIP]) + uleb(5)  # offset rip, CFA-40
        + bytes([0x80 | RSP]) + uleb(2)  # offset rsp, CFA-16
    )  # fmt: skip
    data += fde(stub_cie, len(data), KBASE, 0x100, stub)
    data += fde(0, len(data), KBASE + 0x100, 0x100, b"\x0e" + uleb(16))  # handler: one push
    cfi = CfiTable.parse(data, KBASE + 0x10000)
    return make_module("kernel", KBASE, KBASE + 0x10000, kernel=True, cfi=cfi)


def user_module() -> Module:
    data = cie()
    data += fde(0, len(data), 0x401000, 0x100, b"\x0e" + uleb(16))  # f: one push
    data += fde(0, len(data), 0x401100, 0x100, b"\x07" + uleb(RIP))  # main: outermost
    return make_module("user", 0x400000, 0x500000, kernel=False, cfi=CfiTable.parse(data, 0x402000))


@pytest.mark.parametrize("signal", [True, False])
def test_trap_frame_crosses_into_the_interrupted_user_stack(signal: bool) -> None:
    trap = KSTACK + 16  # the handler's CFA: where the CPU's interrupt frame starts
    words = {
        KSTACK + 8: KBASE + 0x50,  # handler's return address into the stub
        trap: 0x401010,  # interrupted user RIP
        trap + 24: USTACK,  # interrupted user RSP (lower than the kernel stack)
        USTACK + 8: 0x401150,  # f's return address into main
    }
    space = AddressSpace([kernel_module(signal), user_module()])
    raw = Unwinder(X86_64).unwind(regs(KBASE + 0x110, KSTACK, cpl=0), memory(words), space)
    assert raw.pcs == (KBASE + 0x110, KBASE + 0x50, 0x401010, 0x401150)
    assert raw.exact == (True, False, True, False)
    assert raw.stop is StopReason.END
    names = [f.kernel for f in Unwinder(X86_64).resolve(raw, space).frames]
    assert names == [True, True, False, False]


def test_frame_pointer_walk_crosses_a_fake_trap_frame_into_user_code() -> None:
    # The fp kernel's entry stubs push [user rbp, interrupted rip] and point rbp at them.
    handler_rbp, stub_rbp, user_rbp = KSTACK + 0x40, KSTACK + 0x100, USTACK + 0x20
    words = {
        handler_rbp: stub_rbp,  # handler frame: saved rbp...
        handler_rbp + 8: KBASE + 0x50,  # ...and the return address into the stub
        stub_rbp: user_rbp,  # the stub's fake frame: the user's rbp...
        stub_rbp + 8: 0x401010,  # ...and the interrupted user rip
        user_rbp: 0,  # the user function's frame: outermost
        user_rbp + 8: 0x401150,
    }
    space = AddressSpace(
        [
            make_module("kernel", KBASE, KBASE + 0x10000, kernel=True),
            make_module("user", 0x400000, 0x500000, kernel=False),
        ]
    )
    raw = Unwinder(X86_64).unwind(
        regs(KBASE + 0x110, KSTACK, handler_rbp, cpl=0), memory(words), space
    )
    assert raw.pcs == (KBASE + 0x110, KBASE + 0x50, 0x401010, 0x401150)
    assert raw.exact == (True, False, True, False)
    assert raw.stop is StopReason.END


def test_kernel_code_called_from_start_code_in_no_file_ends_there_as_kernel() -> None:
    """A second CPU's start code, copied to 0x7000 (below the boundary, in no file), calls the
    kernel's first function: no trap frame above the frame, no user code at its return address.
    Its frame is kernel code and the outermost one; the space is not missing it."""
    kernel_rbp, start_rbp = KSTACK + 0x40, KSTACK + 0x100
    words = {
        kernel_rbp: start_rbp,  # mpenter's frame: saved rbp...
        kernel_rbp + 8: 0x7077,  # ...and the return address into the start code
        start_rbp: 0,
        start_rbp + 8: 0,
    }
    space = AddressSpace([make_module("kernel", KBASE, KBASE + 0x10000, kernel=True)])
    unwinder = Unwinder(X86_64)
    raw = unwinder.unwind(regs(KBASE + 0x110, KSTACK, kernel_rbp, cpl=0), memory(words), space)
    assert raw.pcs == (KBASE + 0x110, 0x7077)
    assert raw.stop is StopReason.END and raw.outer_kernel
    assert [f.kernel for f in unwinder.resolve(raw, space).frames] == [True, True]
    assert unwinder.unplaced(raw, space) == ()


def test_user_code_never_returns_into_the_kernel() -> None:
    words = {USTACK + 8: KBASE + 0x10}
    raw = Unwinder(X86_64).unwind(
        regs(0x401010, USTACK), memory(words), AddressSpace([user_module()])
    )
    assert raw.pcs == (0x401010,) and raw.stop is StopReason.BAD_RETURN


@pytest.mark.parametrize("mapped", [True, False])
def test_a_return_address_in_page_0_is_judged_by_its_mapping(mapped: bool) -> None:
    """A program linked at address 0 returns into page 0; with nothing mapped there, a return
    address in page 0 is bad."""
    words: dict[int, int] = {}
    for i, ra in enumerate((0x120, 0x230, 0x1340)):
        rbp = STACK + 16 + 32 * i
        words[rbp], words[rbp + 8] = (rbp + 32 if i < 2 else 0), ra
    program = make_module("prog", 0, 0x2000, kernel=False)
    space = AddressSpace([program] if mapped else [])
    raw = Unwinder(X86_64).unwind(regs(0x10, STACK, STACK + 16), memory(words), space)
    if mapped:
        assert raw.pcs == (0x10, 0x120, 0x230, 0x1340) and raw.stop is StopReason.END
    else:
        assert raw.pcs == (0x10,) and raw.stop is StopReason.BAD_RETURN


# --- Symbolize ---------------------------------------------------------------------------


def test_symbolize_looks_callers_up_at_return_address_minus_one() -> None:
    symbols = SymbolTable([Symbol(0x1000, 0x100, "a"), Symbol(0x1100, 0x100, "b")])
    module = make_module("prog", 0x5000, 0x6000, kernel=False, bias=0x4000, symbols=symbols)
    space = AddressSpace([module])
    raw = RawStack((0x5100, 0x5100, 0x9999), StopReason.NO_CFI, (True, False, False))
    stack = Unwinder(X86_64).resolve(raw, space)
    leaf, caller, unknown = stack.frames
    assert (leaf.symbol, leaf.offset, leaf.module_name) == ("b", 0, "prog")
    assert (caller.symbol, caller.offset) == ("a", 0x100)  # a call was a's last instruction
    assert (unknown.symbol, unknown.module_name, unknown.kernel) == (None, None, False)
    assert stack.stop is StopReason.NO_CFI and stack.truncated
    assert Unwinder(X86_64).resolve(raw, space) == stack  # the cached frames are the same


def test_unplaced_are_the_user_addresses_no_module_holds() -> None:
    # A program at 0x5000 and the kernel: the leaf at 0x9000 (in no module), a return address
    # at the end of the program (its call inside it), one just past the program (its call in
    # no module), kernel addresses never.
    prog = make_module("prog", 0x5000, 0x6000, kernel=False)
    kernel = make_module("vmlinux", KBASE, KBASE + 0x1000, kernel=True)
    space = AddressSpace([prog, kernel])
    raw = RawStack(
        (KBASE + 0x10, 0x9000, 0x6000, 0x6001, KBASE + 0x2000),
        StopReason.END,
        (True, True, False, False, False),
    )
    assert Unwinder(X86_64).unplaced(raw, space) == (0x9000, 0x6000)


def test_programs_at_the_same_address_do_not_share_prologue_answers() -> None:
    # Two static programs linked at the same address: at 0x1001 one has just pushed rbp, the
    # other is at the first instruction of a function that starts with `nop; ret`-like code.
    other_code = bytes.fromhex("90c3") + CODE[2:]  # 0x1000 nop, 0x1001 ret
    other = make_module("other", 0x1000, 0x2000, kernel=False, code=other_code, code_addr=0x1000)
    words = {STACK: OUTER, STACK + 8: CALLER, OUTER: 0, OUTER + 8: 0}
    unwinder = Unwinder(X86_64)
    first = unwinder.unwind(
        regs(0x1001, STACK, OUTER), memory(words), AddressSpace([prologue_module()])
    )
    second = unwinder.unwind(regs(0x1001, STACK, OUTER), memory(words), AddressSpace([other]))
    assert first.pcs == (0x1001, CALLER)  # return address above the pushed rbp
    assert second.pcs[:2] == (0x1001, OUTER)  # at `ret`: the return address is [rsp]


def test_code_outside_long_mode_is_not_walked() -> None:
    legacy = x86(0, 0x7C00, 0x7000, 0x7010, cr3=0, long_mode=False)
    raw = Unwinder(X86_64).unwind(legacy, memory({}), AddressSpace([]))
    assert raw.pcs == (0x7C00,) and raw.stop is StopReason.NO_CFI


def rules_module() -> Module:
    r12, r13, r14 = 12, 13, 14
    data = cie()
    for begin, insns in (
        # F1: CFA = rsp+16; rbx's caller value is CFA+32 (val_offset, factored: -4 * -8).
        (0x1000, b"\x0e" + uleb(16) + b"\x15" + uleb(RBX) + sleb(-4)),
        # F2: CFA = rbx + 0; the caller's r12 is in rbx (register rule).
        (0x1100, b"\x0c" + uleb(RBX) + uleb(0) + b"\x09" + uleb(r12) + uleb(RBX)),
        # F3: CFA = r12 + 16; rbx saved at the address CFA - 16 (expression: DW_OP_lit16, minus).
        (0x1200, b"\x0c" + uleb(r12) + uleb(16) + b"\x10" + uleb(RBX) + b"\x02\x40\x1c"),
        # F4: CFA = rbx + 8 (def_cfa_expression: DW_OP_breg3 8); r13 same value, r14 undefined.
        (0x1300, b"\x0f\x02\x73\x08" + b"\x08" + uleb(r13) + b"\x07" + uleb(r14)),
        # F5: the outermost frame.
        (0x1400, b"\x07" + uleb(RIP)),
        # A PLT stub: CFA = rsp+8, or rsp+16 at offsets 11..15 of each 16-byte entry.
        (0x1500, b"\x0f" + uleb(len(PLT_EXPR)) + PLT_EXPR),
    ):
        data += fde(0, len(data), begin, 0x100, insns)
    return make_module("rules", 0x1000, 0x2000, kernel=False, cfi=CfiTable.parse(data, 0x3000))


def test_every_register_rule_kind_feeds_the_next_frame() -> None:
    # Each frame's CFA depends on a register the previous rule recovered: a wrong rule
    # derails the walk.
    s = STACK
    words = {
        s + 8: 0x1150,  # F1's return address (CFA1 = s+16); rbx := CFA1 + 32 = s+48
        s + 40: 0x1250,  # F2's return address (CFA2 = rbx = s+48); r12 := rbx
        s + 56: 0x1350,  # F3's return address (CFA3 = r12 + 16 = s+64)
        s + 48: s + 88,  # F3: rbx saved at CFA3 - 16
        s + 88: 0x1450,  # F4's return address (CFA4 = rbx + 8 = s+96)
    }
    raw = Unwinder(X86_64).unwind(regs(0x1010, s), memory(words), AddressSpace([rules_module()]))
    assert raw.pcs == (0x1010, 0x1150, 0x1250, 0x1350, 0x1450)
    assert raw.stop is StopReason.END
    assert set(raw.via[1:]) == {Via.CFI}


@pytest.mark.parametrize(("pc", "ra_slot"), [(0x1504, STACK), (0x150C, STACK + 8)])
def test_plt_stub_cfa_expression(pc: int, ra_slot: int) -> None:
    words = {ra_slot: 0x1450}
    raw = Unwinder(X86_64).unwind(regs(pc, STACK), memory(words), AddressSpace([rules_module()]))
    assert raw.pcs == (pc, 0x1450) and raw.stop is StopReason.END


def test_a_trap_frame_is_told_from_a_plain_return_address() -> None:
    """Crossing from kernel to user code without CFI: what follows the user RIP on the kernel
    stack must be a user CS and RFLAGS for it to be a trap frame (then RSP is its next slot)."""
    import struct

    from qmpprof.pagecache import PageCache

    page = 0xFFFF_FFFF_8020_0000
    cache = PageCache()
    frame = struct.pack("<5Q", 0x40_1068, 0x23, 0x202, 0x7F_F000, 0x1B)  # rip cs flags rsp ss
    cache.pages[page] = frame + bytes(4096 - len(frame))
    assert X86_64.trap_frame_sp(page + 8, cache.read_u64) == 0x7F_F000
    kernel_cs = struct.pack("<5Q", 0x40_1068, 0x08, 0x202, 0x7F_F000, 0x10)
    cache.pages[page] = kernel_cs + bytes(4096 - len(kernel_cs))
    assert X86_64.trap_frame_sp(page + 8, cache.read_u64) is None  # CPL 0: not from user mode
    junk = struct.pack("<5Q", 0x40_1068, 0x40_2000, 7, 0, 0)
    cache.pages[page] = junk + bytes(4096 - len(junk))
    assert X86_64.trap_frame_sp(page + 8, cache.read_u64) is None  # user stack data, not a CS


def _memory32(words: dict[int, int]) -> PageCache:
    cache = PageCache()
    for addr, value in words.items():
        page = bytearray(cache.pages.get(page_of(addr)) or bytes(PAGE))
        page[addr - page_of(addr) : addr - page_of(addr) + 4] = struct.pack("<I", value)
        cache.pages[page_of(addr)] = bytes(page)
    return cache


def test_i386_frame_pointers_walk_4_byte_words() -> None:
    # [ebp] = caller's ebp, [ebp+4] = return address; the outermost frame's ebp is 0.
    mem = _memory32({0x7FF010: 0x7FF020, 0x7FF014: 0x401234, 0x7FF020: 0, 0x7FF024: 0x401300})
    r = x86(0, 0x401100, 0x7FF000, 0x7FF010, cpl=3, cr3=0, long_mode=False)
    walker = Unwinder(I386)
    raw = walker.unwind(r, mem, AddressSpace([]))
    assert raw.pcs == (0x401100, 0x401234, 0x401300)
    assert raw.stop is StopReason.END
    # An x86_64 walker gives a 32-bit guest its one exact frame, as before.
    assert Unwinder(X86_64).unwind(r, mem, AddressSpace([])).pcs == (0x401100,)


def test_i386_user_space_ends_at_the_3_gib_split_to_the_page() -> None:
    """Code in the last page below 0xc0000000 is user code a user frame returns to; one in the
    first page above is the kernel's, which user code never returns into."""
    r = x86(0, 0x401100, 0x7FF000, 0x7FF010, cpl=3, cr3=0, long_mode=False)
    for caller, pcs, stop in (
        (0xBFFF_F100, (0x401100, 0xBFFF_F100, 0x401300), StopReason.END),
        (0xC000_0100, (0x401100,), StopReason.BAD_RETURN),
    ):
        words = {0x7FF010: 0x7FF020, 0x7FF014: caller, 0x7FF020: 0, 0x7FF024: 0x401300}
        raw = Unwinder(I386).unwind(r, _memory32(words), AddressSpace([]))
        assert (raw.pcs, raw.stop) == (pcs, stop)


def test_an_i386_trap_frame_is_told_from_a_plain_return_address() -> None:
    """i386: after the EIP slot, a user CS and EFLAGS (4 bytes each), then the user ESP."""

    page = 0xC014_5000
    frame = struct.pack("<5I", 0x40_1068, 0x23, 0x202, 0x7F_FFC0, 0x2B)  # eip cs eflags esp ss
    cache = PageCache()
    cache.pages[page] = frame + bytes(PAGE - len(frame))
    assert I386.trap_frame_sp(page + 4, cache.read_u32) == 0x7F_FFC0
    kernel_cs = struct.pack("<3I", 0x40_1068, 0x08, 0x202)
    cache.pages[page] = kernel_cs + bytes(PAGE - len(kernel_cs))
    assert I386.trap_frame_sp(page + 4, cache.read_u32) is None  # ring 0: no user ESP pushed


def test_a_process_whose_user_space_is_gone_ends_at_the_kernel_entry_whole() -> None:
    """An exiting process (its mm released): the walk reaches the trap frame and stops there,
    the stack whole; the interrupted user pc belongs to no space any more."""
    trap = KSTACK + 16
    words = {KSTACK + 8: KBASE + 0x50, trap: 0x401010, trap + 24: USTACK}
    space = AddressSpace([kernel_module(False)], user_gone=True)
    raw = Unwinder(X86_64).unwind(regs(KBASE + 0x110, KSTACK, cpl=0), memory(words), space)
    assert raw.pcs == (KBASE + 0x110, KBASE + 0x50)
    assert raw.stop is StopReason.USER_GONE and raw.stop.whole
    stack = Unwinder(X86_64).resolve(raw, space)
    assert not stack.truncated


def test_a_walk_that_reaches_a_programs_entry_function_is_whole() -> None:
    """Nothing calls a program's entry function (``_start`` at e_entry, here 0x400000-0x400009):
    whatever its frame pointer holds (a word the kernel left), the walk ends there, whole."""
    # main (ebp 0x7FF010) was called from _start (0x400005), whose ebp points at junk.
    words = {0x7FF010: 0x7FF020, 0x7FF014: 0x400005, 0x7FF020: 0x7FF030, 0x7FF024: 0x401300,
             0x7FF030: 0x10}  # fmt: skip
    in_main = x86(0, 0x401100, 0x7FF000, 0x7FF010, cpl=3, cr3=0, long_mode=False)
    in_start = x86(0, 0x400004, 0x7FF018, 0x7FF020, cpl=3, cr3=0, long_mode=False)
    mapping = Mapping("prog", 0x400000, 0x402000, False)
    whole = AddressSpace([Module(mapping, outermost=(0x400000, 0x400009))])
    for r, pcs in ((in_main, (0x401100, 0x400005)), (in_start, (0x400004,))):
        raw = Unwinder(I386).unwind(r, _memory32(words), whole)
        assert (raw.pcs, raw.stop) == (pcs, StopReason.END)
    # The control: without the entry function known, the junk makes up a caller of _start.
    raw = Unwinder(I386).unwind(in_main, _memory32(words), AddressSpace([Module(mapping)]))
    assert raw.pcs[:3] == (0x401100, 0x400005, 0x401300)
