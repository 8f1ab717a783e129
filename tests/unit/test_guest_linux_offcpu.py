"""The off-CPU reading of a Linux task: states decoded as /proc does, the state names read from
the kernel's task_state_array, x86_64's pt_regs found atop a kernel stack with or without the
padding above it and its context switch's frame, arm64's cpu_context and pt_regs. Inputs built
by hand; tests/e2e/test_offcpu_e2e.py and tests/e2e/test_aarch64_e2e.py check them on real
guests."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.x86 import X86_64
from qmpprof.linux.aarch64.cpucontext import CpuContext
from qmpprof.linux.running.offcpu import States, read_states
from qmpprof.linux.x86_64.taskframe import InactiveTaskFrame

# fs/proc/array.c's task_state_array, 4.14 to 7.2
NAMES = (
    ("R", "running"), ("S", "sleeping"), ("D", "disk sleep"), ("T", "stopped"),
    ("t", "tracing stop"), ("X", "dead"), ("Z", "zombie"), ("P", "parked"), ("I", "idle"),
)  # fmt: skip
STATES = States(NAMES)


def test_states_decode_as_proc_does() -> None:
    assert STATES.decode(0, 0) == ("R", "running")
    assert STATES.decode(0x1, 0) == ("S", "sleeping")
    assert STATES.decode(0x2, 0) == ("D", "disk sleep")
    assert STATES.decode(0x102, 0) == ("D", "disk sleep")  # TASK_KILLABLE: WAKEKILL | D
    assert STATES.decode(0x402, 0) == ("I", "idle")  # TASK_IDLE: NOLOAD | D
    assert STATES.decode(0x4, 0) == ("T", "stopped")
    assert STATES.decode(0x8, 0) == ("t", "tracing stop")
    assert STATES.decode(0x40, 0) == ("P", "parked")
    assert STATES.decode(0x80, 0x20) == ("Z", "zombie")  # TASK_DEAD, exit_state EXIT_ZOMBIE


class Memory:
    """Guest memory by hand: address -> bytes."""

    def __init__(self, blocks: dict[int, bytes]) -> None:
        self.blocks = blocks

    async def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for addr, size in ranges:
            found = None
            for start, data in self.blocks.items():
                if start <= addr and addr + size <= start + len(data) and size:
                    found = data[addr - start : addr - start + size]
            out.append(found)
        return out


async def test_state_names_come_from_the_array_in_the_guest() -> None:
    array, strings = 0xFFFF_FFFF_8200_0000, 0xFFFF_FFFF_8210_0000
    texts = [f"{letter} ({name})".encode() + b"\0" for letter, name in NAMES]
    pointers = [strings + 64 * i for i in range(len(texts))] + [0] * 7
    memory = {array: struct.pack("<16Q", *pointers)}
    memory.update({strings + 64 * i: text.ljust(64, b"\0") for i, text in enumerate(texts)})
    found = await read_states(Memory(memory).read, array, X86_64)
    assert found == STATES


async def test_state_names_that_are_not_procs_are_refused() -> None:
    array, strings = 0xFFFF_FFFF_8200_0000, 0xFFFF_FFFF_8210_0000
    memory = {array: struct.pack("<16Q", *([strings] * 16)), strings: b"hello\0".ljust(64, b"\0")}
    assert await read_states(Memory(memory).read, array, X86_64) is None


def layout() -> InactiveTaskFrame:
    names = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx",
             "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "flags", "rsp", "ss")  # fmt: skip
    return InactiveTaskFrame(
        thread_sp=5400, frame_size=56, frame_bp=40, frame_ret=48, regs_size=168,
        regs=tuple((name, 8 * i) for i, name in enumerate(names) if name != "orig_rax"),
    )  # fmt: skip


def pt_regs(pc: int, sp: int, bp: int) -> bytes:
    values = [0] * 21
    values[4], values[16], values[17], values[19], values[20] = bp, pc, 0x33, sp, 0x2B
    return struct.pack("<21Q", *values)


def test_user_registers_are_the_pt_regs_atop_the_kernel_stack() -> None:
    below = bytes(200)  # the kernel stack under pt_regs
    regs = pt_regs(0x401000, 0x7FFF_0000, 0x7FFF_0040)
    for padding in (0, 16):  # CONFIG_X86_FRED kernels leave 16 bytes above pt_regs
        found = layout().user_registers(below + regs + bytes(padding), X86_64)
        assert found is not None and found.user
        assert (found.pc, found.sp, found.fp) == (0x401000, 0x7FFF_0000, 0x7FFF_0040), padding
        assert found.gprs[X86_64.names.index("rbx")] == 0, padding


def test_a_kernel_stack_without_user_registers_gives_none() -> None:
    assert layout().user_registers(bytes(400), X86_64) is None
    assert layout().user_registers(bytes(100), X86_64) is None  # shorter than pt_regs


def test_kernel_registers_are_the_context_switchs_frame() -> None:
    sp, ret, bp = 0xFFFF_C900_0010_3E00, 0xFFFF_FFFF_81CE_CA50, 0xFFFF_C900_0010_3E68
    frame = bytes(40) + struct.pack("<QQ", bp, ret)
    saved = struct.pack("<Q", sp)
    assert layout().stack_pointer(saved) == sp
    found = layout().kernel_registers(saved, frame, sp, X86_64)
    assert found is not None and not found.user
    assert (found.pc, found.sp, found.fp) == (ret, sp + 56, bp)
    # no kernel return address
    assert layout().kernel_registers(saved, bytes(56), sp, X86_64) is None


# bookworm's arm64 6.1 and 6.12 (BTF): cpu_context at task_struct.thread + 0, x19..x28, fp, sp,
# pc; pt_regs of 336 bytes, regs[31] at 0, sp 248, pc 256, pstate 264.
ARM64 = CpuContext(
    context=3024, size=104, registers=tuple((19 + i, 8 * i) for i in range(10)), fp=80, sp=88,
    pc=96, regs_size=336, regs=0, regs_sp=248, regs_pc=256, pstate=264,
)  # fmt: skip
# T1SZ 16, T0SZ 16: pointer-authentication codes in bits 63..48 but 55 (as x30 read on 6.1)
SIGNED = AARCH64.translated({"TCR_EL1": (16 << 16) | 16})


def test_arm64_kernel_registers_are_cpu_context() -> None:
    sp, fp, pc = 0xFFFF_8000_0A2B_3D40, 0xFFFF_8000_0A2B_3D50, 0xFFFF_A735_938D_5AC4
    saved = struct.pack("<13Q", *range(100, 110), fp, sp, 0xAFE5_A735_938D_5AC4)
    assert ARM64.stack_pointer(saved) == sp
    found = ARM64.kernel_registers(saved, b"", sp, SIGNED)
    assert found is not None and not found.user
    assert (found.pc, found.sp, found.fp) == (pc, sp, fp)  # the return address stripped
    assert found.gprs[19] == 100 and found.gprs[28] == 109 and found.gprs[29] == fp
    plain = struct.pack("<13Q", *range(100, 110), fp, sp, pc)
    assert ARM64.kernel_registers(plain, b"", sp, AARCH64) is not None
    # Unknown translation settings: a signed return address is no code address.
    assert ARM64.kernel_registers(saved, b"", sp, AARCH64) is None
    assert ARM64.kernel_registers(bytes(104), b"", sp, SIGNED) is None  # never switched out
    assert ARM64.kernel_registers(saved[:96], b"", sp, SIGNED) is None  # short


def arm64_pt_regs(pc: int, sp: int, pstate: int) -> bytes:
    regs = list(range(1000, 1031))  # x0..x30
    return struct.pack("<31Q", *regs) + struct.pack("<3Q", sp, pc, pstate) + bytes(336 - 272)


def test_arm64_user_registers_are_the_pt_regs_atop_the_kernel_stack() -> None:
    below = bytes(200)
    regs = arm64_pt_regs(0xAAAA_D000_1234, 0xFFFF_F000_0000, 0)  # EL0t
    found = ARM64.user_registers(below + regs, SIGNED)
    assert found is not None and found.user
    assert (found.pc, found.sp, found.fp) == (0xAAAA_D000_1234, 0xFFFF_F000_0000, 1029)
    assert found.gprs[0] == 1000 and found.gprs[30] == 1030
    # A kernel thread's pt_regs says EL1h (5); a 32-bit task's has M[4] set; too short: none.
    assert ARM64.user_registers(below + arm64_pt_regs(0, 0, 0x3C5), SIGNED) is None
    assert ARM64.user_registers(below + arm64_pt_regs(0x1000, 0x2000, 0x10), SIGNED) is None
    assert ARM64.user_registers(bytes(100), SIGNED) is None
