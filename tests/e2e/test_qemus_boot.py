"""The QEMUs the end-to-end tests run on (tests/qemus.py): a guest booted under ``every_qemu``
runs on that very QEMU, and the newest runs on its own tree alone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from guestvm import running_guest
from qemus import UNSTABLE, Qemu, every_qemu
from support.bench.rawqmp import RawQmp


@pytest.mark.qemu
@every_qemu
def test_a_guest_boots_on_the_qemu_of_its_test_id(tmp_path: Path, qemu_build: Qemu) -> None:
    assert shutil.which("qemu-system-x86_64") == shutil.which(qemu_build.binary())
    with running_guest(tmp_path) as guest, RawQmp(str(guest.qmp_socket)) as qmp:
        found = qmp.execute("query-version")["qemu"]
    assert f"{found['major']}.{found['minor']}.{found['micro']}" == qemu_build.version


@pytest.mark.qemu
def test_the_newest_runs_on_its_own_tree_alone(tmp_path: Path) -> None:
    """scripts/fetch-qemu's wrapper: the tree's ld.so, libraries and firmware, none of the
    host's (bookworm's glibc is older than the binary needs; its firmware is 7.2's)."""
    assert UNSTABLE.bindir is not None
    tree = (UNSTABLE.bindir.parent / "root").resolve()
    with running_guest(tmp_path, qemu=UNSTABLE.binary()) as guest:
        maps = Path(f"/proc/{guest.process.pid}/maps").read_text()
    mapped = {line.split()[-1] for line in maps.splitlines() if line.split()[-1].startswith("/")}
    libraries = {Path(name) for name in mapped if ".so" in Path(name).name}
    assert any(path.name == "libc.so.6" for path in libraries), sorted(mapped)
    assert all(path.is_relative_to(tree) for path in libraries), sorted(mapped)
    found = subprocess.run(
        [UNSTABLE.binary(), "-L", "help"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert found[:3] == [
        str(tree / d) for d in ("usr/share/qemu", "usr/share/seabios", "usr/lib/ipxe/qemu")
    ]
