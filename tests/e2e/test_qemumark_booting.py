"""The ``qemu`` marker told by use (tests/qemumark.py): a fixture declared as booting QEMU marks
the tests using it, and an unmarked test that boots QEMU fails. No QEMU runs here: a program
whose file is named ``qemu-system-x86_64`` (a link to sleep) stands for one."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import qemumark
from qemumark import boots_qemu
from test_qemumark import named_qemu


@pytest.fixture
@boots_qemu
def fake_booted(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with named_qemu(tmp_path) as proc:
        yield proc


def test_a_test_using_a_booting_fixture_is_marked(
    fake_booted: subprocess.Popen[bytes], request: pytest.FixtureRequest
) -> None:
    assert request.node.get_closest_marker("qemu") is not None
    assert qemumark.marked
    assert (fake_booted.pid, "qemu-system-x86") in qemumark.qemu_descendants()
