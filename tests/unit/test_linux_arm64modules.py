"""The module list's head of an arm64 kernel, read from ``find_module_all``'s code: on bookworm's
6.1 (whose kallsyms name no data) and 6.12 it must be the -dbg vmlinux's ``modules`` (and on
6.12 kallsyms' own); hand-made sequences for what must not be taken."""

from __future__ import annotations

import struct
import subprocess

import pytest
from aarch64vm import SERIES, image

from qmpprof.linux.aarch64.modulelist import list_head
from qmpprof.linux.kernel import LinuxKernel

pytestmark = pytest.mark.linux

AT = 0xFFFF_8000_0815_4218  # in find_module_all, bookworm's 6.1.0-56
# adrp x21, 0xffff800009d5c000; add x21, x21, #0x9c0; stp x19, x20, [sp, #16];
# mov x24, x0; ldr x0, [x21, #80]!; cmp x0, x21 -- as 6.1.0-56 has them.
SEQUENCE = [0x9000E055, 0x912702B5, 0xA90153F3, 0xAA0003F8, 0xF8450EA0, 0xEB15001F]
HEAD = 0xFFFF_8000_09D5_CA10


def words(*insns: int) -> bytes:
    return struct.pack(f"<{len(insns)}I", *insns)


def test_the_loop_s_end_test_gives_the_head() -> None:
    assert list_head(words(*SEQUENCE), AT) == HEAD
    assert list_head(words(*SEQUENCE[:-1], 0xEB0002BF), AT) == HEAD  # cmp x21, x0
    # No anchor: ldr x0, [x21] from the head itself.
    assert list_head(words(*SEQUENCE[:-2], 0xF94002A0, 0xEB15001F), AT) == HEAD - 80


@pytest.mark.parametrize(
    ("index", "word"),
    [
        (5, 0xEB16001F),  # cmp x0, x22: not the register the link was loaded from
        (4, 0xF8450EA1),  # ldr x1, [x21, #80]!: the compared register was not loaded
        (3, 0xAA0003F5),  # mov x21, x0: the address is gone before the load
        (0, 0x9000E056),  # adrp x22: the register loaded from was never given an address
    ],
)
def test_a_different_sequence_is_not_taken(index: int, word: int) -> None:
    changed = list(SEQUENCE)
    changed[index] = word
    assert list_head(words(*changed), AT) is None


def dbg_modules(series: str) -> int:
    """``modules`` in the series' -dbg vmlinux (scripts/setup fetches it), by nm."""
    nm = subprocess.run(
        ["nm", str(SERIES[series] / "vmlinux-dbg")], capture_output=True, text=True, check=True
    )
    (found,) = [line.split()[0] for line in nm.stdout.splitlines() if line.endswith(" modules")]
    return int(found, 16)


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_bookworm_kernels_place_the_module_list(series: str) -> None:
    kernel = LinuxKernel.load(image(series))
    from_symbols = kernel.symbols.address_of("modules")
    found = kernel.module_list
    assert found == dbg_modules(series)
    if series == "6.12":  # kallsyms with data symbols
        assert from_symbols == found
    else:
        assert from_symbols is None
