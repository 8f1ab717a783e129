"""Shared pytest fixtures. The bundled guest: built once per session, booted per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import linuximage
import pytest
from guestvm import Guest, build_fixtures, running_guest


@pytest.fixture(scope="session")
def guest_build() -> None:
    """Both variants of fixtures/guest built (scripts/build-fixtures, once per session)."""
    build_fixtures()


@pytest.fixture
def guest(tmp_path: Path, guest_build: None) -> Iterator[Guest]:
    """The cfi build on one vCPU, workload running; QEMU is killed afterwards."""
    with running_guest(tmp_path, "cfi", 1) as g:
        yield g


@pytest.fixture(scope="session")
def linux_vmlinux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Debian's 6.12 vmlinux ELF, decompressed from its vmlinuz (tests/linuximage.py)."""
    return linuximage.vmlinux(tmp_path_factory.mktemp("linux"))
