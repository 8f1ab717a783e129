"""The QEMUs the end-to-end tests run on (tests/qemus.py): each test id names the version the
binary prints, and a missing build is named missing."""

from __future__ import annotations

from pathlib import Path

from qemus import HOST, QEMUS, UNSTABLE, Qemu


def test_the_ids_are_the_versions_and_the_newest_is_newer() -> None:
    assert [q.test_id for q in QEMUS] == [f"qemu-{HOST.version}", f"qemu-{UNSTABLE.version}"]
    versions = [tuple(int(part) for part in str(q.version).split(".")) for q in QEMUS]
    assert versions[1] > versions[0] >= (7, 2)


def test_a_missing_build_is_named_missing(tmp_path: Path) -> None:
    absent = Qemu("nowhere", tmp_path / "bin")
    assert absent.version is None
    assert absent.test_id == "qemu-nowhere-missing"
    assert "scripts/fetch-qemu" in absent.missing()
