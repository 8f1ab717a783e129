"""scripts/deb_member.py (how scripts/fetch-linux-dbg takes the vmlinux out of a -dbg package)
against small .debs built here: a multi-block xz data archive as dpkg-deb writes them (made with
xz --block-size), the member found at either end of the tar, a symlink of the same name passed
over, a damaged block refused by liblzma's check, and the archives it cannot seek in."""

from __future__ import annotations

import gzip
import importlib.util
import io
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest
from linuxvm import ROOT

BLOCK = 64 << 10  # xz block size here; dpkg-deb's threads use 24 MiB


def deb_member() -> ModuleType:
    path = ROOT / "scripts" / "deb_member.py"
    spec = importlib.util.spec_from_file_location("deb_member", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def payload(seed: int, size: int) -> bytes:
    """Bytes that compress a little (xz has work to do) and differ per seed."""
    out = bytearray()
    x = seed
    while len(out) < size:
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out += (x >> 40).to_bytes(3, "little") * 3
    return bytes(out[:size])


def tar_of(files: list[tuple[str, bytes | str]]) -> bytes:
    """A tar as dpkg-deb writes it: ./-prefixed names; a str value is a symlink's target."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, content in files:
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def xz_blocks(data: bytes) -> bytes:
    return subprocess.run(
        ["xz", "-T1", "-1", f"--block-size={BLOCK}", "-c"], input=data, capture_output=True,
        check=True,
    ).stdout  # fmt: skip


def write_deb(path: Path, data_name: str, data: bytes) -> Path:
    """An ar archive: debian-binary, control.tar.xz, data.tar.* (what dpkg-deb writes)."""
    out = bytearray(b"!<arch>\n")
    for name, content in (
        ("debian-binary", b"2.0\n"),
        ("control.tar.xz", b"x" * 7),
        (data_name, data),
    ):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(content):<10}`\n".encode()
        out += content + b"\n" * (len(content) % 2)
    path.write_bytes(bytes(out))
    return path


VMLINUX = payload(1, 300_000)  # several blocks long
FILES: list[tuple[str, bytes | str]] = [
    ("./usr/lib/debug/boot/System.map-7", payload(2, 5_000)),
    *[
        (f"./usr/lib/debug/lib/modules/7/kernel/m{i}.ko", payload(10 + i, 40_000))
        for i in range(12)
    ],
    ("./usr/lib/debug/lib/modules/7/vmlinux", VMLINUX),
    ("./usr/lib/debug/boot/vmlinux-7", "../lib/modules/7/vmlinux"),
]
NAMES = ["./usr/lib/debug/boot/vmlinux-7", "./usr/lib/debug/lib/modules/7/vmlinux"]


@pytest.mark.parametrize("where", ["last", "first"])
def test_member_found_at_either_end(tmp_path: Path, where: str) -> None:
    files = FILES if where == "last" else [FILES[-2], *FILES[:-2], FILES[-1]]
    archive = xz_blocks(tar_of(files))
    deb = write_deb(tmp_path / "k.deb", "data.tar.xz", archive)
    module = deb_member()
    with deb.open("rb") as f:
        kind, offset, size = module.data_member(f)
        _flags, blocks = module.xz_blocks(f, offset, size)
    assert kind == "data.tar.xz" and size == len(archive)
    assert len(blocks) > 8  # the member spans several blocks, the search crosses some
    out = tmp_path / "vmlinux"
    assert module.main([str(deb), str(out), *NAMES, "--workers", "2"]) == 0
    assert out.read_bytes() == VMLINUX


def test_missing_member(tmp_path: Path) -> None:
    deb = write_deb(tmp_path / "k.deb", "data.tar.xz", xz_blocks(tar_of(FILES[:3])))
    out = tmp_path / "vmlinux"
    assert deb_member().main([str(deb), str(out), *NAMES]) == 4
    assert not out.exists()


def test_damaged_block_is_refused(tmp_path: Path) -> None:
    deb = write_deb(tmp_path / "k.deb", "data.tar.xz", xz_blocks(tar_of(FILES)))
    module = deb_member()
    with deb.open("rb") as f:
        _kind, offset, size = module.data_member(f)
        _flags, blocks = module.xz_blocks(f, offset, size)
    damaged = bytearray(deb.read_bytes())
    block = blocks[-2]  # one of the member's
    damaged[offset + block.offset + block.unpadded // 2] ^= 0x40
    deb.write_bytes(bytes(damaged))
    with pytest.raises(module.lzma.LZMAError):
        module.main([str(deb), str(tmp_path / "vmlinux"), *NAMES])
    assert not (tmp_path / "vmlinux").exists()


@pytest.mark.parametrize("kind", ["gzip", "one block too large"])
def test_archives_it_cannot_seek_in(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit status 3: scripts/fetch-linux-dbg then has tar read the stream."""
    module = deb_member()
    if kind == "gzip":
        deb = write_deb(tmp_path / "k.deb", "data.tar.gz", gzip.compress(tar_of(FILES)))
    else:
        monkeypatch.setattr(module, "_MAX_BLOCK", BLOCK // 2)
        deb = write_deb(tmp_path / "k.deb", "data.tar.xz", xz_blocks(tar_of(FILES)))
    assert module.main([str(deb), str(tmp_path / "vmlinux"), *NAMES]) == 3
