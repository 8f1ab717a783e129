"""ElfImage and its CfiTable on the i386 build of the bundled guest (fixtures/build/i386):
ELF32/EM_386 headers and symbols, and CFI rows in i386 DWARF registers (eip 8, esp 4, ebp 5)
for a user function, a frameless leaf, an entry stub's trap frame and the outermost frames.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from guestvm import BUILD_ROOT, build_fixtures, expected, section

from qmpprof.arch.x86 import I386
from qmpprof.dwarf.cfi import Kind, RegRule, Rule
from qmpprof.dwarf.expr import evaluate
from qmpprof.elf.image import ElfImage
from qmpprof.unwind.space import Module

BUILD = BUILD_ROOT / "i386"
EXPECTED = expected("i386")
EIP, ESP, EBP = I386.pc, I386.sp, I386.fp
RA_AT_CFA_MINUS_4 = RegRule(Kind.OFFSET, -4)


@pytest.fixture(scope="module")
def kernel() -> ElfImage:
    build_fixtures(("i386",))
    return ElfImage.load(BUILD / "kernel.elf")


@pytest.fixture(scope="module")
def spin() -> ElfImage:
    build_fixtures(("i386",))
    return ElfImage.load(BUILD / "user" / "spin.elf")


def _pyelftools_functions(path: Path) -> dict[str, tuple[int, int]]:
    with path.open("rb") as f:
        symtab = section(ELFFile(f), ".symtab")
        return {
            s.name: (s["st_value"], s["st_size"])
            for s in symtab.iter_symbols()
            if s["st_info"]["type"] == "STT_FUNC"
        }


def _row(image: ElfImage, pc: int) -> Rule:
    assert image.cfi is not None
    row = image.cfi.row_for(pc)
    assert row is not None, f"no CFI row at {pc:#x}"
    return row


def test_headers_and_layout(kernel: ElfImage, spin: ElfImage) -> None:
    assert kernel.arch is I386 and spin.arch is I386
    boundary = int(EXPECTED["kernel_boundary"], 16)
    assert kernel.load_range[0] >= boundary and kernel.load_range[1] < 1 << 32
    assert kernel.text_addr >= boundary
    assert spin.load_range[0] == int(EXPECTED["user_link_address"], 16)
    assert spin.entry == spin.symbols.address_of("_start")
    assert spin.text_bytes and spin.text_sha256
    assert kernel.cfi is not None and kernel.cfi.address_size == 4


@pytest.mark.parametrize("program", ["kernel", "spin", "sys"])
def test_symbols_match_pyelftools(program: str) -> None:
    """Elf32_Sym entries are read as such: every function resolves to its name, at any offset."""
    build_fixtures(("i386",))
    path = BUILD / ("kernel.elf" if program == "kernel" else f"user/{program}.elf")
    image = ElfImage.load(path)
    functions = _pyelftools_functions(path)
    assert functions
    for name, (start, size) in functions.items():
        assert image.symbols.lookup(start) == (name, 0), name
        if size > 1:
            assert image.symbols.lookup(start + size - 1) == (name, size - 1), name
    for name in EXPECTED["syscall_path"] + EXPECTED["interrupt_path"]:
        if program == "kernel":
            assert image.symbols.address_of(name) is not None, name


def test_user_function_rows_walk_the_frame_pointer_prologue(spin: ElfImage) -> None:
    """spin_hot: push %ebp; mov %esp,%ebp. CFA = esp+4, then esp+8 (ebp saved at CFA-8), then
    ebp+8; the return address stays at CFA-4 throughout."""
    start = spin.symbols.address_of("spin_hot")
    assert start is not None and spin.text_bytes[start - spin.text_addr :][:3] == b"\x55\x89\xe5"
    rows = [_row(spin, start + delta) for delta in (0, 1, 3)]
    assert [(r.cfa_reg, r.cfa_offset) for r in rows] == [(ESP, 4), (ESP, 8), (EBP, 8)]
    assert all(r.ra == EIP and r.reg(EIP) == RA_AT_CFA_MINUS_4 for r in rows)
    assert rows[1].reg(EBP) == RegRule(Kind.OFFSET, -8)
    assert not any(r.signal for r in rows)


def test_no_cfi_function_has_no_row(spin: ElfImage) -> None:
    for name in EXPECTED["no_cfi"]["spin"]:
        start = spin.symbols.address_of(name)
        assert start is not None and spin.cfi is not None
        assert spin.cfi.row_for(start) is None, name


def test_frameless_leaf_and_outermost_frames(kernel: ElfImage, spin: ElfImage) -> None:
    for name in EXPECTED["frameless_leaf"]["kernel"]:
        start = kernel.symbols.address_of(name)
        assert start is not None
        row = _row(kernel, start + 4)
        assert (row.cfa_reg, row.cfa_offset, row.reg(EIP)) == (ESP, 4, RA_AT_CFA_MINUS_4)
    outermost = EXPECTED["outermost"]
    for image, name in ((spin, outermost["user"]), (kernel, outermost["kernel_thread"])):
        start = image.symbols.address_of(name)
        assert start is not None
        assert _row(image, start).reg(EIP) == RegRule(Kind.UNDEFINED), name


@pytest.mark.parametrize(("cs", "interrupted_esp"), [(0x23, 0x7FFFC0), (0x08, None)])
def test_entry_stub_rows_describe_the_trap_frame(
    kernel: ElfImage, cs: int, interrupted_esp: int | None
) -> None:
    """entry_syscall's first row: a signal frame, CFA = esp+12 (just above eflags), eip at
    CFA-12, and esp by an expression: the pushed esp from ring 3, the CFA from ring 0."""
    start = kernel.symbols.address_of("entry_syscall")
    assert start is not None
    row = _row(kernel, start)
    assert row.signal and (row.cfa_reg, row.cfa_offset) == (ESP, 12)
    assert row.reg(EIP) == RegRule(Kind.OFFSET, -12)
    rule = row.reg(ESP)
    assert rule is not None and rule.kind is Kind.VAL_EXPRESSION
    cfa = 0xC0140F00
    words = {cfa - 8: cs, cfa: 0x7FFFC0}

    def read(addr: int) -> int:
        return words.get(addr, 0) | words.get(addr + 4, 0) << 32

    value = evaluate(rule.expr, {}, read, push=cfa, address_size=I386.address_size)
    assert value == (cfa if interrupted_esp is None else interrupted_esp)
    # The same rule at the first instruction of every entry stub.
    for stub in EXPECTED["entry_stubs"]:
        begin = kernel.symbols.address_of(stub)
        assert begin is not None
        assert _row(kernel, begin).reg(ESP) == rule, stub


def test_modules_get_i386_steps(kernel: ElfImage) -> None:
    module = Module.from_image(kernel, kernel=True)
    assert [type(step).__name__ for step in module.steps] == [
        "CfiStep", "ReturnScanStep", "PrologueStep", "ReturnScanStep", "FramePointerStep",
    ]  # fmt: skip
    assert all(getattr(step, "arch", None) is I386 for step in module.steps)


def test_deref_size_4_reads_only_its_bytes_at_a_page_end() -> None:
    # [CFA] with the CFA 4 bytes below a page end: an 8-byte read would need the next page.
    cfa = 0x7F_FFFC
    asked: list[tuple[int, int]] = []

    def read_bytes(addr: int, size: int) -> bytes:
        asked.append((addr, size))
        return (0x1234).to_bytes(size, "little")

    def read_u64(addr: int) -> int:
        raise AssertionError("the 8-byte read must not be used")

    expr = bytes((0x94, 4))  # DW_OP_deref_size 4
    value = evaluate(expr, {}, read_u64, push=cfa, address_size=4, read_bytes=read_bytes)
    assert (value, asked) == (0x1234, [(cfa, 4)])
    assert (
        evaluate(b"\x06", {}, read_u64, push=cfa, address_size=4, read_bytes=read_bytes) == 0x1234
    )
    assert asked[-1] == (cfa, 4)  # DW_OP_deref: the address size
