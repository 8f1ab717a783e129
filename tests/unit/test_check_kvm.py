"""scripts/check-kvm, the one command docs/kvm.md gives for booting every bundled variant under
KVM: a QEMU that dies at once must be reported as a failure of each variant, with its status (the
real run under TCG: tests/e2e/test_check_kvm_tcg.py)."""

from __future__ import annotations

import subprocess

from kvmcheck import CHECK, RUN_TIMEOUT


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
