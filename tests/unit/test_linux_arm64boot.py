"""init_task and THREAD_SIZE read from arm64's __primary_switched, and task_state_array found by
its content: sequences built by hand from the instructions bookworm's 6.1 has there (the real
Images are checked in tests/unit/test_linux_arm64image.py)."""

from __future__ import annotations

import struct

import pytest

from qmpprof.linux.aarch64.bootcode import read_boot_task
from qmpprof.linux.aarch64.trampoline import swapper_offset, vectors_literal
from qmpprof.linux.platform import BootTask
from qmpprof.linux.taskstates import state_array_in

AT = 0xFFFF_8000_0966_8FDC  # __primary_switched on 6.1.0-56
# bti c; adrp x4, 0xffff800009cc8000; add x4, x4, #0xdc0; msr sp_el0, x4;
# ldr x5, [x4, #0x20]; add sp, x5, #4, lsl #12; sub sp, sp, #0x150 (capstone's reading)
WORDS = [0xD503245F, 0x90003304, 0x91370084, 0xD5184104, 0xF9401085, 0x914010BF, 0xD10543FF]


def code(words: list[int]) -> bytes:
    return struct.pack(f"<{len(words)}I", *words)


def test_the_boot_code_gives_init_task_and_the_stack_size() -> None:
    assert read_boot_task(code(WORDS), AT, 0x20) == BootTask(0xFFFF_8000_09CC_8DC0, 0x4000)


@pytest.mark.parametrize(
    ("index", "word"),
    [
        (3, 0xD5184105),  # msr sp_el0, x5: another register than the task's
        (4, 0xF9401485),  # ldr x5, [x4, #0x28]: not task_struct.stack
        (5, 0x910540BF),  # add sp, x5, #0x150: not a stack size
        (5, 0x914010DF),  # add sp, x6, ...: not the stack loaded
    ],
)
def test_a_different_sequence_is_not_taken(index: int, word: int) -> None:
    words = list(WORDS)
    words[index] = word
    assert read_boot_task(code(words), AT, 0x20) is None


def test_the_stack_offset_is_btfs() -> None:
    assert read_boot_task(code(WORDS), AT, 0x28) is None
    assert read_boot_task(b"", AT, 0x20) is None


def test_the_state_array_is_found_by_its_strings() -> None:
    base = 0xFFFF_8000_0800_0000
    strings = b"\0R (running)\0S (sleeping)\0D (disk sleep)\0"
    running, sleeping = base + 1, base + 13
    decoy = struct.pack("<2Q", running, base + 40)  # R, then no "S (sleeping)": not it
    array = struct.pack("<3Q", running, sleeping, base + 26)
    data = strings.ljust(48, b"\0") + decoy + array
    assert state_array_in(data, base) == base + 48 + 16
    assert state_array_in(strings.ljust(48, b"\0") + decoy, base) is None


# tramp_map_kernel on 6.1: mrs x30, ttbr1_el1; add x30, x30, #2, lsl #12;
# and x30, x30, #0xfffeffffffffffff; msr ttbr1_el1, x30
TRAMP = [0xD538203E, 0x91400BDE, 0x924FFBDE, 0xD518203E]
NOP = 0xD503201F


def test_the_trampolines_offset_is_what_it_adds() -> None:
    assert swapper_offset(code([NOP, *TRAMP, NOP, *TRAMP])) == 0x2000
    assert swapper_offset(code([NOP, NOP])) is None


@pytest.mark.parametrize(
    ("index", "word"),
    [
        (1, 0x91400BDD),  # add x29, x30, ...: another register
        (1, 0xD1400BDE),  # sub: the way back to the trampoline
        (2, 0xB24003DE),  # orr x30, x30, #USER_ASID_FLAG: not the kernel's ASID
        (3, 0xD518203D),  # msr ttbr1_el1, x29
    ],
)
def test_another_sequence_says_nothing(index: int, word: int) -> None:
    words = list(TRAMP)
    words[index] = word
    assert swapper_offset(code([NOP, *words])) is None


def test_copies_that_disagree_say_nothing() -> None:
    other = [TRAMP[0], 0x91400FDE, *TRAMP[2:]]  # add x30, x30, #3, lsl #12
    assert swapper_offset(code([*TRAMP, *other])) is None
    assert swapper_offset(code([NOP, *TRAMP[:3]])) is None  # cut short


# tramp_vectors+0x44c on 6.1: isb; ldr x30, 0xffff800009654000; prfm ...; msr vbar_el1, x30
ENTRY = 0xFFFF_8000_0965_144C
LITERAL = [0xD5033FDF, 0x58015D9E, 0xF98203C9, 0xD518C01E]


def test_the_vector_entry_loads_the_kernels_vectors_from_a_literal() -> None:
    assert vectors_literal(code(LITERAL), ENTRY) == 0xFFFF_8000_0965_4000
    backwards = [0x58FFFFFE, LITERAL[3]]  # ldr x30, . - 4
    assert vectors_literal(code(backwards), ENTRY) == ENTRY - 4
    assert vectors_literal(code([LITERAL[1], 0xD518C01D]), ENTRY) is None  # msr of x29
    assert vectors_literal(code(LITERAL[:3]), ENTRY) is None  # no msr vbar_el1
