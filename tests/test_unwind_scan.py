"""Code with neither CFI nor frame pointers, followed to its return (unwind/scan.py,
arch/x86scan.py): a real gcc build (tests/data/nocfi.c, -fno-asynchronous-unwind-tables
-fomit-frame-pointer -O2, stripped) walked from the stack it dumps of itself, checked against the
call chain it has by construction (named from the unstripped build); and hand-assembled code for
what the scan must refuse."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
from fakes import make_module
from test_unwind_chain import memory, regs

from qmpprof.arch.x86 import X86_64
from qmpprof.elf.image import ElfImage
from qmpprof.model import StopReason
from qmpprof.pagecache import PAGE, PageCache, page_of
from qmpprof.unwind.chain import AddressSpace, Module, Unwinder, Via

DATA = Path(__file__).parent / "data"
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
    found = [names.lookup(p if i == 0 else p - 1) for i, p in enumerate(raw.pcs[:4])]
    assert [hit and hit[0] for hit in found] == ["leaf", "mid", "outer", "main"]
    assert raw.via[:4] == (Via.REGS, Via.SCAN, Via.SCAN, Via.SCAN)
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
    return AddressSpace(
        [make_module("prog", CODE_ADDR, CODE_ADDR + 0x1000, kernel=False, code=code,
                     code_addr=CODE_ADDR)]
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
