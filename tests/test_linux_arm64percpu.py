"""The per-CPU area of an arm64 kernel, read from the EL0 handler's code (``ldr_this_cpu`` of
``__entry_task`` before ``msr sp_el0``): on bookworm's 6.12, whose kallsyms name the data
symbols, it must be theirs; on 6.1, whose kallsyms do not, it must be where the same code puts
it; and hand-made sequences for what must not be taken."""

from __future__ import annotations

import struct

import pytest
from aarch64vm import image

from qmpprof.guest.linux.current import locate_current
from qmpprof.linux.arm64percpu import entry_task, indexed_array, per_cpu_offsets
from qmpprof.linux.kernel import LinuxKernel

pytestmark = pytest.mark.linux

HANDLER = 0xFFFF_8000_0801_1474
# adrp x28, 0xffff800009804000; add x28, x28, #0x308; mrs x20, tpidr_el1;
# ldr x28, [x28, x20]; msr sp_el0, x28 -- as bookworm's 6.1.0-56 has them in el0t_64_sync.
SEQUENCE = [0xF000BF9C, 0x910C239C, 0xD538D094, 0xF8746B9C, 0xD518411C]


def words(*insns: int) -> bytes:
    return struct.pack(f"<{len(insns)}I", *insns)


def test_the_sequence_gives_the_variable() -> None:
    code = words(0xD503201F, *SEQUENCE)  # a nop before: found past the handler's start
    assert entry_task(code, HANDLER - 4) == 0xFFFF_8000_0980_4308


@pytest.mark.parametrize(
    ("index", "word"),
    [
        (2, 0xD53BD054),  # mrs x20, tpidr_el0: the user's thread pointer, not a per-CPU offset
        (3, 0xF8746B9B),  # ldr x27, [x28, x20]: not the register SP_EL0 gets
        (4, 0xD518411B),  # msr sp_el0, x27: not the register loaded
        (1, 0x910C2380),  # add x0, x28, #0x308: the address built in another register
    ],
)
def test_a_different_sequence_is_not_taken(index: int, word: int) -> None:
    changed = list(SEQUENCE)
    changed[index] = word
    assert entry_task(words(*changed), HANDLER) is None


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_bookworm_kernels_place_the_current_task(series: str) -> None:
    kernel = LinuxKernel.load(image(series))
    start = kernel.per_cpu_start
    assert start is not None and start % 4096 == 0
    variable, note = locate_current(kernel)
    assert note is None and variable.moves
    assert kernel.btf is not None
    assert variable.link == start + kernel.btf.percpu("__entry_task")[0]
    from_symbols = kernel.symbols.address_of("__entry_task")
    if series == "6.12":  # kallsyms with data symbols: the code must agree with them
        assert from_symbols == variable.link
        assert kernel.symbols.address_of("__per_cpu_start") == start
    else:
        assert from_symbols is None


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_the_scheduler_s_code_places_the_per_cpu_offsets(series: str) -> None:
    kernel = LinuxKernel.load(image(series))
    assert kernel.btf is not None and kernel.per_cpu_start is not None
    found = per_cpu_offsets(kernel.image, kernel.symbols, kernel.btf, kernel.per_cpu_start)
    assert found is not None and found % 8 == 0
    assert kernel.per_cpu_offsets == (kernel.symbols.address_of("__per_cpu_offset") or found)
    if series == "6.12":  # kallsyms with data symbols: the code must agree with them
        assert found == kernel.symbols.address_of("__per_cpu_offset")


def test_an_array_not_added_to_the_variable_is_not_taken() -> None:
    # idle_cpu as 6.12.117 has it: adrp/add the array, adrp/add runqueues, ldr [x2, w0, sxtw
    # #3], add x1, x1, x0.
    at = 0xFFFF_8000_8011_BF48
    code = words(0x90012B42, 0x9107E042, 0xD000F261, 0x91170021, 0xF860D840, 0x8B000021)
    array, runqueues = 0xFFFF_8000_8268_31F8, 0xFFFF_8000_81F6_95C0
    assert indexed_array(code, at, runqueues) == array
    assert indexed_array(code, at, runqueues + 8) is None  # another variable's address
    assert indexed_array(code[:-4], at, runqueues) is None  # the value is never added
