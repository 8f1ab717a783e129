"""riscv64 Linux's exception entry: read from trixie's 6.12 vmlinux (its symbols, BTF and code:
``linux/riscv64/entry.py``) and crossed (``unwind/savedregs.py``) from a ``pt_regs`` laid out in
memory as ``handle_exception`` stores it, into the interrupted kernel or user code."""

from __future__ import annotations

import struct

import pytest
from guestvm import BUILD_ROOT

from qmpprof.arch.riscv64 import RISCV64
from qmpprof.arch.riscv64code import SP, decode, length, word
from qmpprof.linux.btf import Btf
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.riscv64 import entry as riscv64_entry
from qmpprof.linux.riscv64.entry import SEPC, entry_code
from qmpprof.model import StopReason
from qmpprof.pagecache import PAGE, PageCache, page_of
from qmpprof.unwind.savedregs import SavedRegsEntry
from qmpprof.unwind.steps import EXACT, NEW_STACK

VMLINUX = BUILD_ROOT / "linux-riscv64" / "vmlinux-dbg"
PC, SP_REG, RA, S0 = RISCV64.pc, 2, 1, 8
KSTACK = 0xFF20_0000_0001_3E00
INTERRUPTED = {RA: 0xFFFF_FFFF_8000_2222, SP_REG: 0xFF20_0000_0001_3F80, S0: 0xFF20_0000_0001_3FA0}


@pytest.fixture(scope="module")
def kernel() -> LinuxKernel:
    if not VMLINUX.is_file():
        pytest.fail(f"{VMLINUX} is missing: run scripts/setup")
    return LinuxKernel.load(VMLINUX)


@pytest.fixture(scope="module")
def code(kernel: LinuxKernel) -> SavedRegsEntry:
    found = entry_code(kernel)
    assert isinstance(found, SavedRegsEntry), found
    return found


def insn_at(kernel: LinuxKernel, addr: int) -> tuple[str, int, int, int]:
    text = kernel.image.text_bytes
    assert text is not None
    found = word(text, addr - kernel.image.text_addr)
    assert found is not None
    return decode(found)


def test_the_6_12_entry_is_read_from_its_code(kernel: LinuxKernel, code: SavedRegsEntry) -> None:
    symbols = kernel.image.symbols
    entry, back = symbols.address_of("handle_exception"), symbols.address_of("ret_from_exception")
    assert code.entry[0][0] == entry and code.entry[1][0] == back
    # Live from the entry to its first write of sp; pt_regs whole from the instruction after a
    # store to sp-relative memory, and on the way back up to the load of sp, which ends it.
    (live_start, live_end), (after_load, back_end) = code.live
    assert live_start == entry and insn_at(kernel, live_end)[1] == SP
    (saved_start, entry_end), (saved_back, load_end) = code.saved
    assert entry_end == code.entry[0][1] and saved_back == back and after_load == load_end
    kinds = [insn_at(kernel, at) for at in range(saved_start - 4, saved_start, 2)]
    assert any(kind == "sd" and base == SP for kind, _, base, _ in kinds)
    text = kernel.image.text_bytes
    assert text is not None
    size = length(text, after_load - 4 - kernel.image.text_addr)
    assert insn_at(kernel, after_load - size) == ("ld", SP, SP, code.regs + 8 * SP)
    assert back_end == code.entry[1][1]
    assert (code.link, code.link_name, code.from_kernel) == (SEPC, "sepc", 1 << 8)


def pt_regs(epc: int, status: int) -> PageCache:
    """Memory holding a pt_regs at KSTACK as handle_exception stores it: x_n at 8n, epc at 0,
    status at 256 (6.12's layout)."""
    values = {0: epc, 256: status}
    values.update({8 * n: 0x1000 + n for n in range(1, 32)})
    values.update({8 * n: v for n, v in INTERRUPTED.items()})
    page = bytearray(PAGE)
    for offset, value in values.items():
        struct.pack_into("<Q", page, KSTACK - page_of(KSTACK) + offset, value)
    cache = PageCache()
    cache.pages[page_of(KSTACK)] = bytes(page)
    return cache


def test_a_handler_s_caller_in_the_entry_crosses_into_the_interrupted_kernel_code(
    code: SavedRegsEntry,
) -> None:
    step = code.step(0, RISCV64)
    at = code.saved[0][0] + 0x20  # a return address after the handler's call
    cur = {PC: at, SP_REG: KSTACK, S0: 0, RA: 0}
    found = step.step(cur, at - 1, False, pt_regs(0xFFFF_FFFF_8012_3456, 0x100 | 0x20))
    assert isinstance(found, tuple)
    new, flags = found
    assert flags == EXACT and new[PC] == 0xFFFF_FFFF_8012_3456
    assert {n: new[n] for n in INTERRUPTED} == INTERRUPTED and new[5] == 0x1005


def test_from_user_mode_the_walk_goes_on_in_the_user_code(code: SavedRegsEntry) -> None:
    step = code.step(0, RISCV64)
    at = code.saved[1][0]  # ret_from_exception's first instruction, stopped there
    found = step.step({PC: at, SP_REG: KSTACK}, at, True, pt_regs(0x2_A000, 0x20))
    assert isinstance(found, tuple)
    new, flags = found
    assert flags == EXACT | NEW_STACK and new[PC] == 0x2_A000
    assert new[SP_REG] == INTERRUPTED[SP_REG]


def test_before_anything_is_saved_the_pc_is_sepc_and_the_rest_the_cpu_s(
    code: SavedRegsEntry,
) -> None:
    step = code.step(0, RISCV64)
    at = code.live[0][0] + 4
    cur = {PC: at, SP_REG: 0xFF20_0000_0001_3F80, S0: 7, RA: 9}
    assert code.holds_link(at) and not code.holds_link(code.saved[0][0])
    assert step.step(cur, at, True, PageCache()) == StopReason.NO_CFI  # sepc not read
    found = step.step({**cur, SEPC: 0xFFFF_FFFF_8000_4444}, at, True, PageCache())
    assert found == ({**cur, PC: 0xFFFF_FFFF_8000_4444}, EXACT)


def test_where_the_frame_is_half_made_the_walk_stops_and_elsewhere_it_is_not_the_step_s(
    code: SavedRegsEntry,
) -> None:
    step = code.step(0, RISCV64)
    half = code.live[0][1] + 2  # sp lowered, pt_regs not stored yet
    assert step.step({PC: half, SP_REG: KSTACK}, half, True, PageCache()) == StopReason.NO_CFI
    outside = code.entry[1][1] + 0x100
    assert step.step({PC: outside, SP_REG: KSTACK}, outside, True, PageCache()) is None


def test_a_kernel_whose_entry_stores_other_than_pt_regs_is_said_in_one_line(
    kernel: LinuxKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pt_regs whose status lies where the entry stores nothing: the code is not read.
    real = riscv64_entry.pt_regs  # as entry.py imported it

    def moved(btf: Btf) -> dict[str, int] | None:
        found = real(btf)
        return None if found is None else {**found, "status": found["status"] + 0x100}

    monkeypatch.setattr(riscv64_entry, "pt_regs", moved)
    found = entry_code(kernel)
    assert isinstance(found, str) and "no shape qmpprof knows" in found
    assert "pt_regs" in found and "\n" not in found
