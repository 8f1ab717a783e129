"""An initramfs unpacked for its user programs (linux/initramfs.py): the Linux test guest's own
(built by scripts/build-linux-guest from the rootfs folder beside it) unpacks to that folder's
regular files, byte for byte; archives built here by hand (the newc format, one field a line)
show the segments Debian's initrd.img has (an uncompressed one, then a compressed one), names
that would leave the folder and links not written, and damage told in one line."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest
import zstandard
from guestvm import BUILD_ROOT

from qmpprof.errors import KernelImageError
from qmpprof.linux import initramfs

REG, DIR, LINK = 0o100644, 0o040755, 0o120777


def entry(name: str, mode: int, data: bytes = b"") -> bytes:
    """One newc entry: the header's 13 fields of 8 hex digits, the name, data, each padded."""
    fields = [
        1,  # c_ino
        mode,  # c_mode
        0, 0,  # c_uid, c_gid
        1,  # c_nlink
        0,  # c_mtime
        len(data),  # c_filesize
        0, 0, 0, 0,  # c_devmajor, c_devminor, c_rdevmajor, c_rdevminor
        len(name) + 1,  # c_namesize, its NUL included
        0,  # c_check
    ]  # fmt: skip
    head = b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0"
    head += bytes(-len(head) % 4)
    return head + data + bytes(-len(data) % 4)


def archive(*entries: bytes) -> bytes:
    return b"".join(entries) + entry("TRAILER!!!", 0)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_linux_guests_initramfs_is_its_rootfs() -> None:
    build = BUILD_ROOT / "linux-guest"  # built by scripts/setup (scripts/build-linux-guest)
    folder = initramfs.unpacked(build / "initramfs.cpio.gz")
    rootfs = build / "rootfs"
    files = [p for p in rootfs.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(files) > 10
    for path in files:
        unpacked = folder / path.relative_to(rootfs)
        assert unpacked.read_bytes() == path.read_bytes(), unpacked
    assert not any(p.is_symlink() for p in folder.rglob("*"))
    assert initramfs.unpacked(build / "initramfs.cpio.gz") == folder  # kept, not unpacked again


def test_an_uncompressed_segment_then_a_compressed_one(tmp_path: Path) -> None:
    early = archive(entry("kernel", DIR), entry("kernel/microcode.bin", REG, b"ucode"))
    main = archive(
        entry("usr/bin", DIR),
        entry("usr/bin/xz", REG, b"\x7fELF xz"),
        entry("bin", LINK, b"usr/bin"),  # a link: a path in the guest, not written here
        entry("/etc/passwd", REG, b"root"),  # a leading / kept inside
        entry("../escape", REG, b"no"),
    )
    path = tmp_path / "initrd.img"
    path.write_bytes(early + bytes(512) + zstandard.ZstdCompressor().compress(main))
    folder = initramfs.unpacked(path)
    found = {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()}
    assert sorted(found) == ["etc/passwd", "kernel/microcode.bin", "usr/bin/xz"]
    assert found["usr/bin/xz"].read_bytes() == b"\x7fELF xz"
    assert not (folder / "bin").exists() and not (tmp_path / "escape").exists()


def test_damage_is_one_line(tmp_path: Path) -> None:
    whole = archive(entry("a", REG, b"x" * 100))
    for name, data in [
        ("cut", whole[:150]),
        ("gzip-cut", gzip.compress(whole)[:40]),
        ("text", b"hello, not an archive"),
    ]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(KernelImageError) as found:
            initramfs.unpacked(path)
        assert "\n" not in str(found.value) and str(path) in str(found.value), name
    assert not list((tmp_path / "cache" / "initramfs").glob("*")), "nothing half-written kept"


def test_a_changed_file_is_unpacked_again(tmp_path: Path) -> None:
    path = tmp_path / "initrd"
    path.write_bytes(archive(entry("one", REG, b"1")))
    first = initramfs.unpacked(path)
    path.write_bytes(archive(entry("two", REG, b"2")))
    os.utime(path, ns=(1, 1))
    second = initramfs.unpacked(path)
    assert first != second and (second / "two").read_bytes() == b"2"
