"""Which tests boot QEMU, told by what they use rather than by hand.

A fixture that boots QEMU says so with ``@boots_qemu`` (under its ``@pytest.fixture``); conftest
gives every test using such a fixture the ``qemu`` marker, so ``-m "not qemu"`` (the unit tier of
scripts/test) never boots one. What no fixture declares is caught when it happens: the boot
helpers (guestvm, linuxvm, aarch64vm, witnessvm) call ``booting``, and conftest fails an
unmarked test that started a QEMU still running once its fixtures are set up or its body ends
(a command line the test starts itself)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., object])

# The fixture functions that boot QEMU. Fixture names repeat across files (``guest``,
# ``booted``): the function itself tells them apart.
BOOTING: set[Callable[..., object]] = set()

# Boots per boot helper in this session.
BOOTS: Counter[str] = Counter()

# Whether the test being run carries the ``qemu`` marker (set by conftest around each test;
# True outside a test, for fixtures and scripts that use the helpers on their own).
marked = True


def boots_qemu(fixture: F) -> F:
    """Declare a fixture function as one that boots QEMU (put it under ``@pytest.fixture``)."""
    BOOTING.add(fixture)
    return fixture


def uses_booting_fixture(item: pytest.Item) -> bool:
    """Whether a collected test uses, directly or through other fixtures, a declared one."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        fixturedef.func in BOOTING
        for fixturedefs in info.name2fixturedefs.values()
        for fixturedef in fixturedefs
    )


def booting(what: str) -> None:
    """Fail the running test when it boots QEMU without the ``qemu`` marker; else count the
    boot by ``what`` (conftest prints the counts at the end of the session)."""
    if not marked:
        pytest.fail(f"{what} boots QEMU in a test without the qemu marker", pytrace=False)
    BOOTS[what] += 1


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone meanwhile
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses


def qemu_descendants(ancestor: int | None = None) -> list[tuple[int, str]]:
    """The live processes under ``ancestor`` (this process by default) whose command name says
    QEMU (``qemu-system-x86``: the kernel keeps 15 characters of the program's file name)."""
    ancestor = os.getpid() if ancestor is None else ancestor
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if not name.startswith("qemu-system"):
            continue
        pid = int(entry.name)
        parent: int | None = pid
        while parent is not None and parent > 1 and parent != ancestor:
            parent = _parent(parent)
        if parent == ancestor:
            found.append((pid, name))
    return found


def check_unmarked(item: pytest.Item, before: set[int], when: str) -> None:
    """Fail an unmarked test that has a QEMU running under this process which was not running
    before the test's setup began (a guest of a wider scope, booted by a marked test, may
    still run)."""
    if item.get_closest_marker("qemu") is not None:
        return
    started = [(pid, name) for pid, name in qemu_descendants() if pid not in before]
    if started:
        pids = ", ".join(f"{name} pid {pid}" for pid, name in started)
        pytest.fail(
            f"QEMU running ({pids}) {when} of a test without the qemu marker", pytrace=False
        )
