"""riscv64 Linux's off-CPU registers (linux/riscv64/threadstruct.py): the layout read from the
real trixie 6.12 vmlinux's BTF, and a switched-out task's thread_struct and the pt_regs atop its
kernel stack built by hand. tests/e2e/test_riscv64_linux_e2e.py checks them on the guest."""

from __future__ import annotations

import struct
from pathlib import Path

from qmpprof.arch.riscv64 import RISCV64
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.riscv64.running import RISCV64 as RISCV64_LINUX
from qmpprof.linux.riscv64.threadstruct import ThreadStruct
from qmpprof.linux.running.guest import Layouts
from qmpprof.linux.running.offcpu import OffCpuLayout

VMLINUX = Path(__file__).parents[2] / "fixtures" / "build" / "linux-riscv64" / "vmlinux-dbg"
# trixie's 6.12 (pahole on its vmlinux-dbg): task_struct.thread at 3088, thread_struct's ra, sp,
# s[12] first; pt_regs 288 bytes, epc at 0, then x1..x31, status at 256.
TRIXIE = ThreadStruct(thread=3088, size=112, ra=0, sp=8, s=16, regs_size=288, epc=0, status=256)
SV39 = RISCV64.translated({"satp": 8 << 60})
SR_SPP, SR_SPIE = 1 << 8, 1 << 5


def test_the_layout_is_read_from_the_kernel_s_btf() -> None:
    kernel = LinuxKernel.load(VMLINUX)
    assert kernel.btf is not None
    assert RISCV64_LINUX.switch_layout(kernel.btf, RISCV64) == TRIXIE
    offcpu = Layouts.of(kernel).offcpu
    assert isinstance(offcpu, OffCpuLayout) and offcpu.switch == TRIXIE
    assert TRIXIE.saved == (3088, 112)


def saved(ra: int, sp: int, s0: int) -> bytes:
    """thread_struct's first 112 bytes as __switch_to stores them: ra, sp, s0..s11."""
    return struct.pack("<14Q", ra, sp, s0, *range(101, 112))


def test_a_switched_out_task_resumes_at_its_saved_ra_with_its_sp_and_s0() -> None:
    ra = 0xFFFF_FFFF_80C4_1A2E  # in __schedule, after its call of __switch_to
    sp, s0 = 0xFF20_0000_0012_3D80, 0xFF20_0000_0012_3E00
    data = saved(ra, sp, s0)
    assert TRIXIE.stack_pointer(data) == sp
    found = TRIXIE.kernel_registers(data, b"", sp, SV39)
    assert found is not None and not found.user
    assert (found.pc, found.sp, found.fp) == (ra, sp, s0)
    assert found.gprs[8] == s0 and found.gprs[9] == 101  # s0, s1
    assert found.gprs[18] == 102 and found.gprs[27] == 111  # s2 .. s11
    assert TRIXIE.kernel_registers(bytes(112), b"", sp, SV39) is None  # never switched out
    assert TRIXIE.kernel_registers(data[:104], b"", sp, SV39) is None  # short
    assert TRIXIE.kernel_registers(saved(0x5555_0000, sp, s0), b"", sp, SV39) is None  # user


def pt_regs(epc: int, sp: int, status: int) -> bytes:
    """epc, x1..x31 (x2 = sp, x8 = 1008), status, badaddr, cause, orig_a0."""
    gprs = [1000 + n for n in range(1, 32)]
    gprs[1] = sp
    return struct.pack("<32Q", epc, *gprs) + struct.pack("<4Q", status, 0, 8, 0)


def test_user_registers_are_the_pt_regs_atop_the_kernel_stack() -> None:
    below = bytes(200)
    epc, sp = 0x3F_9A12_3456, 0x3F_FFFF_F000
    found = TRIXIE.user_registers(below + pt_regs(epc, sp, SR_SPIE), SV39)
    assert found is not None and found.user
    assert (found.pc, found.sp, found.fp) == (epc, sp, 1008)
    assert found.gprs[1] == 1001 and found.gprs[31] == 1031 and found.gprs[64] == epc
    # A kernel thread's pt_regs says it came from supervisor mode (SPP); too short: none.
    assert TRIXIE.user_registers(below + pt_regs(0, 0, SR_SPP | SR_SPIE), SV39) is None
    kernel_pc = 0xFFFF_FFFF_8000_1000
    assert TRIXIE.user_registers(below + pt_regs(kernel_pc, sp, SR_SPIE), SV39) is None
    assert TRIXIE.user_registers(bytes(100), SV39) is None
