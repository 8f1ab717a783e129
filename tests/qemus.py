"""The QEMUs the end-to-end tests run on: the host's (Debian bookworm's 7.2) and the newest of
Debian unstable, unpacked by scripts/fetch-qemu into fixtures/build/qemu-unstable.

A test or a module goes on every QEMU by one line::

    pytestmark = [pytest.mark.qemu, every_qemu]      # or @every_qemu on one test

``every_qemu`` parametrises the ``qemu_build`` fixture (tests/conftest.py, autouse), whose ids
are the versions the binaries print (``[qemu-7.2.22]``, ``[qemu-11.1.3]``). For the test's
duration that QEMU's folder comes first on PATH, so whatever starts ``qemu-system-x86_64`` or
``qemu-system-i386`` by name (scripts/run-guest, hence ``running_guest``; ``qmpprof record``;
a test's own command line) starts it. A guest booted by a fixture of a wider scope than the
test is booted before that and stays on the host's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

BUILD_ROOT = Path(__file__).resolve().parent.parent / "fixtures" / "build"
# The x86_64 QEMU by name: what every_qemu puts first on PATH is the one that starts.
QEMU = "qemu-system-x86_64"


@dataclass(frozen=True)
class Qemu:
    """One QEMU: ``bindir`` holds its qemu-system-x86_64 and qemu-system-i386 (None: the
    host's, found on PATH)."""

    name: str
    bindir: Path | None

    def binary(self, target: str = "x86_64") -> str:
        program = f"qemu-system-{target}"
        return program if self.bindir is None else str(self.bindir / program)

    @cached_property
    def version(self) -> str | None:
        """What the binary says it is (``7.2.22``), None when it is not there or does not run."""
        program = shutil.which(self.binary())
        if program is None:
            return None
        done = subprocess.run([program, "--version"], capture_output=True, text=True, check=False)
        words = done.stdout.split()
        return (
            words[3]
            if done.returncode == 0 and words[:3] == ["QEMU", "emulator", "version"]
            else None
        )

    @property
    def test_id(self) -> str:
        return f"qemu-{self.version}" if self.version else f"qemu-{self.name}-missing"

    def path_env(self) -> str:
        """PATH with this QEMU's folder first."""
        path = os.environ.get("PATH", os.defpath)
        return path if self.bindir is None else f"{self.bindir}{os.pathsep}{path}"

    def missing(self) -> str:
        """Why this QEMU cannot run, as a test failure says it."""
        if self.bindir is None:
            return "qemu-system-x86_64 is not on PATH (scripts/setup installs it)"
        return f"{self.bindir} has no QEMU that runs: run scripts/fetch-qemu"


HOST = Qemu("host", None)
UNSTABLE = Qemu("unstable", BUILD_ROOT / "qemu-unstable" / "bin")
QEMUS = (HOST, UNSTABLE)

every_qemu = pytest.mark.parametrize(
    "qemu_build", QEMUS, ids=[qemu.test_id for qemu in QEMUS], indirect=True
)
