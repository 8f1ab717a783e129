"""The ``qemu`` marker told by use (tests/qemumark.py): a test using no booting fixture is not
marked, and an unmarked test that boots QEMU fails. No QEMU runs here: a program whose file is
named ``qemu-system-x86_64`` (a link to sleep) stands for one."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import qemumark
from aarch64vm import running_aarch64_guest
from guestvm import running_guest
from linuxvm import running_linux_guest
from namedqemu import named_qemu
from witnessvm import vm


def running_qemus() -> set[int]:
    return {pid for pid, _name in qemumark.qemu_descendants()}


def test_a_test_using_none_is_not(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("qemu") is None
    assert not qemumark.marked


def test_qemu_under_this_process_is_found_and_its_end_seen(tmp_path: Path) -> None:
    with named_qemu(tmp_path) as proc, subprocess.Popen(["sleep", "60"]) as sibling:
        assert (proc.pid, "qemu-system-x86") in qemumark.qemu_descendants()
        assert proc.pid not in dict(qemumark.qemu_descendants(ancestor=sibling.pid))
        sibling.kill()
    assert proc.pid not in dict(qemumark.qemu_descendants())


def test_an_unmarked_test_running_a_qemu_it_started_fails(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    before = running_qemus()  # a shared guest of an earlier test may be running
    with named_qemu(tmp_path) as proc:
        with pytest.raises(pytest.fail.Exception, match=rf"qemu-system-x86 pid {proc.pid}[,)]"):
            qemumark.check_unmarked(request.node, before, "in the body")
        # One running before the test began (a guest of a wider scope) is not its own.
        qemumark.check_unmarked(request.node, {*before, proc.pid}, "in the body")


BOOT_HELPERS: list[tuple[str, Callable[[Path], Any]]] = [
    ("running_guest", running_guest),
    ("running_linux_guest", running_linux_guest),
    ("running_aarch64_guest", running_aarch64_guest),
    ("witnessvm.vm", vm),
]


@pytest.mark.parametrize(("name", "boot"), BOOT_HELPERS, ids=[n for n, _ in BOOT_HELPERS])
def test_the_boot_helpers_refuse_an_unmarked_test(
    name: str, boot: Callable[[Path], Any], tmp_path: Path
) -> None:
    boots, before = qemumark.BOOTS[name], running_qemus()
    with (
        pytest.raises(pytest.fail.Exception, match=f"{name} boots QEMU in a test without"),
        boot(tmp_path),
    ):
        pass
    assert running_qemus() == before
    assert qemumark.BOOTS[name] == boots  # a refused boot is not counted
