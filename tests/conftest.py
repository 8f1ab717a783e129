"""Shared pytest fixtures. The bundled guest: built once per session, booted per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
