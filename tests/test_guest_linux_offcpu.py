"""The off-CPU reading of a Linux task: states decoded as /proc does, the state names read from
the kernel's task_state_array, and the pt_regs found atop a kernel stack with or without the
padding above it. Inputs built by hand; tests/test_offcpu_e2e.py checks them on real guests."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from qmpprof.arch.x86 import X86_64
from qmpprof.guest.linux.offcpu import (
    OffCpuLayout,
    States,
    kernel_registers,
    read_states,
    user_registers,
)

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


def layout() -> OffCpuLayout:
    names = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx",
             "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "flags", "rsp", "ss")  # fmt: skip
    return OffCpuLayout(
        state=24, state_size=4, exit_state=2000, nvcsw=2100, nivcsw=2108, thread_sp=5400,
        signal=3000, thread_node=2600, thread_head=16, frame_size=56, frame_bp=40, frame_ret=48,
        regs_size=168,
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
        found = user_registers(below + regs + bytes(padding), layout(), X86_64)
        assert found is not None and found.user
        assert (found.pc, found.sp, found.fp) == (0x401000, 0x7FFF_0000, 0x7FFF_0040), padding
        assert found.gprs[X86_64.names.index("rbx")] == 0, padding


def test_a_kernel_stack_without_user_registers_gives_none() -> None:
    assert user_registers(bytes(400), layout(), X86_64) is None
    assert user_registers(bytes(100), layout(), X86_64) is None  # shorter than pt_regs


def test_kernel_registers_are_the_context_switchs_frame() -> None:
    sp, ret, bp = 0xFFFF_C900_0010_3E00, 0xFFFF_FFFF_81CE_CA50, 0xFFFF_C900_0010_3E68
    frame = bytes(40) + struct.pack("<QQ", bp, ret)
    found = kernel_registers(frame, sp, layout(), X86_64)
    assert found is not None and not found.user
    assert (found.pc, found.sp, found.fp) == (ret, sp + 56, bp)
    assert kernel_registers(bytes(56), sp, layout(), X86_64) is None  # no kernel return address
