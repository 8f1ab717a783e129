"""The ``qemu`` marker told by use (tests/qemumark.py): a fixture declared as booting QEMU marks
the tests using it (the rest of the marker's checks: tests/unit/test_qemumark.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import qemumark
from namedqemu import named_qemu
from qemumark import boots_qemu


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
