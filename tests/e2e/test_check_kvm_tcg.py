"""scripts/check-kvm run with ``--accel tcg`` (the accelerator every test uses): both probes of
the machine must print what a conforming x86 CPU prints and each bundled variant reach its
workload."""

from __future__ import annotations

import re
import subprocess

import pytest
from kvmcheck import CHECK, RUN_TIMEOUT
from qemus import every_qemu

VARIANTS = ("fp", "cfi", "i386", "i386-pae")


@pytest.mark.qemu
@every_qemu
def test_every_variant_runs_its_workload_under_tcg() -> None:
    done = subprocess.run(
        [CHECK, "--accel", "tcg", "--timeout", "60"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert lines[:2] == [
        "probe paging32: prints AB as a conforming x86 CPU does",
        "probe syscall64: prints LU0 as a conforming x86 CPU does",
    ], done.stdout
    assert [line.split(":")[0] for line in lines[2:]] == list(VARIANTS), done.stdout
    for line in lines[2:]:
        assert re.fullmatch(r"[\w-]+: runs its workload \(\d+ s\)", line), line
    assert done.returncode == 0, done.stderr
