"""The per-CPU area, ``__per_cpu_offset`` and ``__entry_task`` of an arm64 kernel, read from its
code: ``setup_per_cpu_areas`` (the area's start subtracted, the array stored into) and the EL0
handler (``ldr_this_cpu`` of ``__entry_task`` before ``msr sp_el0``). The sequences as bullseye's
5.10 and bookworm's 6.1 have them, and changed where they must not be taken; on bookworm's 6.12,
whose kallsyms name the data symbols, what the code says must be theirs. (Every arm64 kernel
against its own System.map: ``scripts/check-kernels --arch arm64``, docs/aarch64.md.)"""

from __future__ import annotations

import struct

import pytest
from aarch64vm import image

from qmpprof.linux.aarch64.percpu import entry_task, per_cpu_layout, setup_areas
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.current import locate_current

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


def test_bullseye_510_s_el0_sync_gives_its_entry_task() -> None:
    # el0_sync of 5.10.0-30-arm64 at +0xb8: adrp x28, 0xffff8000113c3000; add x28, x28, #0x2a8;
    # mrs x20, tpidr_el1; ldr x28, [x28, x20]; msr sp_el0, x28 (its System.map: __entry_task
    # at 0xffff8000113c32a8). Its BTF has no per-CPU variables: this address is the one used.
    code = words(0xD5384115, 0xD0009D9C, 0x910AA39C, 0xD538D094, 0xF8746B9C, 0xD518411C)
    assert entry_task(code, 0xFFFF_8000_1001_1E34) == 0xFFFF_8000_113C_32A8


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


# setup_per_cpu_areas of 5.10.0-30-arm64 from 0xffff800011278da8 (its System.map:
# __per_cpu_start 0xffff8000113c3000, __per_cpu_offset 0xffff8000117c9880).
SETUP_AT = 0xFFFF_8000_1127_8DA8
SETUP = [
    0x90FFE121,  # adrp x1, 0xffff800010e9c000       pcpu_base_addr's page
    0xF0000A56,  # adrp x22, 0xffff8000113c3000
    0x910002C0,  # add x0, x22, #0                  __per_cpu_start
    0xB0002A93,  # adrp x19, 0xffff8000117c9000
    0xF9414C36,  # ldr x22, [x1, #0x298]            pcpu_base_addr
    0x91200273,  # add x19, x19, #0x800
    0xD0002A95,  # adrp x21, 0xffff8000117ca000
    0xD0002A94,  # adrp x20, 0xffff8000117ca000
    0x91020273,  # add x19, x19, #0x80              __per_cpu_offset
    0x910302B5,  # add x21, x21, #0xc0
    0x910B8294,  # add x20, x20, #0x2e0
    0xCB0002D6,  # sub x22, x22, x0                 delta
    0x12800000,  # mov w0, #-1
    0xAA1503E1,  # mov x1, x21
    0x97CCAC98,  # bl cpumask_next
    0xB9400281,  # ldr w1, [x20]
    0x6B00003F,  # cmp w1, w0
    0x540000E9,  # b.ls (the end)
    0x90FFE121,  # adrp x1, 0xffff800010e9c000
    0xF9413421,  # ldr x1, [x1, #0x268]             pcpu_unit_offsets
    0xF8605821,  # ldr x1, [x1, w0, uxtw #3]
    0x8B160021,  # add x1, x1, x22
    0xF8205A61,  # str x1, [x19, w0, uxtw #3]       __per_cpu_offset[cpu] = ...
    0xD65F03C0,  # ret (the loop's b and the epilogue left out)
]


def test_bullseye_510_s_setup_per_cpu_areas_gives_the_area_and_the_offsets() -> None:
    assert setup_areas(words(*SETUP), SETUP_AT) == (0xFFFF_8000_113C_3000, 0xFFFF_8000_117C_9880)


@pytest.mark.parametrize(
    ("index", "word"),
    [
        (21, 0x8B150021),  # add x1, x1, x21: the value stored does not add the difference
        (11, 0xCB1602C0),  # sub x0, x22, x22: nothing made by adrp/add is subtracted
        (22, 0xF8205A6A),  # str x10, [x19, w0, uxtw #3]: another register stored
        (22, 0xF8204A61),  # str x1, [x19, w0, uxtw]: an index not scaled by 8
        (16, 0xD65F03C0),  # ret before the store: past the function
        (10, 0x97CCAC98),  # bl between add x0 and the sub: a call leaves x0 unknown
    ],
)
def test_a_different_setup_is_not_taken(index: int, word: int) -> None:
    changed = list(SETUP)
    changed[index] = word
    assert setup_areas(words(*changed), SETUP_AT) is None


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_bookworm_kernels_place_the_per_cpu_area_and_the_current_task(series: str) -> None:
    kernel = LinuxKernel.load(image(series))
    layout = per_cpu_layout(kernel.image, kernel.symbols)
    assert layout is not None and layout[0] % 4096 == 0 and layout[1] % 8 == 0
    assert (kernel.per_cpu_start, kernel.per_cpu_offsets) == layout
    variable, note = locate_current(kernel)
    assert note is None and variable.moves  # the code's __entry_task is BTF's too
    assert kernel.btf is not None
    assert variable.link == layout[0] + kernel.btf.percpu("__entry_task")[0]
    assert kernel.data_symbol("__entry_task") == variable.link
    names = ("__per_cpu_start", "__per_cpu_offset", "__entry_task")
    from_symbols = tuple(kernel.symbols.address_of(name) for name in names)
    if series == "6.12":  # kallsyms with data symbols: the code must agree with them
        assert from_symbols == (*layout, variable.link)
    else:
        assert from_symbols == (None, None, None)
