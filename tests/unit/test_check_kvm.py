"""scripts/check-kvm, the one command docs/kvm.md gives for booting every bundled variant under
KVM: run with ``--accel tcg`` (the accelerator every test uses) both probes of the machine must
print what a conforming x86 CPU prints and each variant reach its workload, and a QEMU that
dies at once must be reported as a failure of each, with its status."""

from __future__ import annotations

import re
import subprocess

import pytest
from guestvm import ROOT
from qemus import every_qemu

CHECK = ROOT / "scripts" / "check-kvm"
VARIANTS = ("fp", "cfi", "i386", "i386-pae")
RUN_TIMEOUT = 300.0  # four boots of at most --timeout each, on a loaded 2-core host


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


def test_a_qemu_that_exits_at_once_is_a_failure() -> None:
    done = subprocess.run(
        [CHECK, "--accel", "tcg", "--qemu", "false", "cfi"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"{name}: FAILS: QEMU exited (status 1); its console's last line: (nothing)"
        for name in ("probe paging32", "probe syscall64", "cfi")
    ]
