"""Which boot panics tests/linuxvm.py makes again: only an int3 Oops whose address no longer
holds an int3 (a stale TCG translation of the kernel's own text patching), and within a
ceiling. The console is a real one: Debian's 6.12 under QEMU 7.2's TCG, from a CI run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import linuxvm
import pytest
import qemumark

CONSOLE = Path(__file__).resolve().parent.parent / "data" / "console" / "stale-int3-6.12.txt"


@pytest.fixture
def boots() -> Iterator[None]:
    saved = qemumark.BOOTS.copy()
    qemumark.BOOTS.clear()
    yield
    qemumark.BOOTS.clear()
    qemumark.BOOTS.update(saved)


def test_an_int3_memory_no_longer_holds_is_stale() -> None:
    assert linuxvm.stale_int3(CONSOLE.read_text())


def test_an_int3_memory_still_holds_is_not() -> None:
    # the byte before the marked one is the int3's: 0xcc there is a patch in progress (or a
    # breakpoint of someone's), which the kernel should have claimed: a real failure
    text = CONSOLE.read_text().replace("53 66 <90>", "53 cc <90>")
    assert not linuxvm.stale_int3(text)


def test_other_panics_are_not() -> None:
    assert not linuxvm.stale_int3("[ 1.0] Kernel panic - not syncing: VFS: Unable to mount root fs")
    oops = CONSOLE.read_text().replace("Oops: int3", "Oops: general protection fault")
    assert not linuxvm.stale_int3(oops)


@pytest.mark.usefixtures("boots")
def test_the_ceiling_is_a_fifth_of_the_linux_boots() -> None:
    qemumark.BOOTS["running_linux_guest"] = 27
    qemumark.BOOTS[linuxvm.STALE_INT3] = 5
    assert linuxvm.stale_int3_over_ceiling() is None
    qemumark.BOOTS[linuxvm.STALE_INT3] = 6
    assert linuxvm.stale_int3_over_ceiling() == (
        "6 of 27 Linux boots panicked on a stale int3: more than 20%"
    )


def test_only_the_first_oops_counts() -> None:
    first = "[ 1.0] Oops: general protection fault, probably for non-canonical address\n"
    assert not linuxvm.stale_int3(first + CONSOLE.read_text())
