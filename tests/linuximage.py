"""The stock Linux kernel the tests read: Debian bookworm's 6.12 ``vmlinuz`` and the vmlinux ELF
inside it. ``scripts/fetch-linux`` puts the vmlinuz in fixtures/build/linux/ when it exists;
otherwise it is fetched here with ``apt-get download`` (nothing is installed). The ELF is
decompressed from the bzImage payload for each test session (a fraction of a second)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import shutil
import struct
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINUX = ROOT / "fixtures" / "build" / "linux"
PACKAGE = re.compile(r"^linux-image-6\.12\.(\d+)\+deb12-amd64 ", re.M)


def vmlinuz(directory: Path = LINUX) -> Path:
    """The 6.12 bzImage, fetched once."""
    path = directory / "vmlinuz"
    if not path.exists():
        fetch = ROOT / "scripts" / "fetch-linux"
        if fetch.exists():
            subprocess.run([str(fetch)], check=True)
        else:
            _download(path)
    return path


def _download(path: Path) -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("a Debian 6.12 kernel is needed: no apt-get/dpkg-deb to download it")
    found = subprocess.run(
        ["apt-cache", "search", "--names-only", "^linux-image-6.12"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    releases = sorted(int(m[1]) for m in PACKAGE.finditer(found))
    if not releases:
        pytest.skip("no linux-image-6.12.*+deb12-amd64 package known to apt (apt-get update?)")
    name = f"linux-image-6.12.{releases[-1]}+deb12-amd64"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "-q", name], cwd=tmp, check=True)
        deb = next(Path(tmp).glob("*.deb"))
        tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True)
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
            member = next(m for m in archive if m.name.startswith("./boot/vmlinuz-"))
            data = archive.extractfile(member)
            assert data is not None
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(".part")
            part.write_bytes(data.read())
            part.replace(path)


def vmlinux_bytes(image: Path) -> bytes:
    """The ELF inside a bzImage: the boot header locates the compressed payload."""
    data = image.read_bytes()
    setup_sects = data[0x1F1] or 4
    offset, length = struct.unpack_from("<II", data, 0x248)
    start = (setup_sects + 1) * 512 + offset
    payload = data[start : start + length]
    if payload.startswith(b"\xfd7zXZ"):
        return lzma.LZMADecompressor().decompress(payload)
    if payload.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=io.BytesIO(payload)).read()
    if payload.startswith(b"BZh"):
        return bz2.BZ2Decompressor().decompress(payload)
    if payload.startswith(b"\x28\xb5\x2f\xfd"):
        return _unzstd(payload)
    raise AssertionError(f"{image}: unknown payload compression {payload[:4].hex()}")


def _unzstd(payload: bytes) -> bytes:
    try:
        import zstandard
    except ImportError:
        if shutil.which("zstd") is None:
            pytest.skip("a zstd-compressed kernel needs the zstandard module or the zstd tool")
        done = subprocess.run(["zstd", "-dcq"], input=payload, capture_output=True)
        return done.stdout  # zstd complains about the size word the kernel appends
    # The kernel's frame declares no content size and a 128 MiB window: stream it.
    return bytes(
        zstandard.ZstdDecompressor(max_window_size=1 << 31).decompressobj().decompress(payload)
    )


def vmlinux(directory: Path) -> Path:
    """The 6.12 vmlinux ELF, written into ``directory``."""
    path = directory / "vmlinux"
    path.write_bytes(vmlinux_bytes(vmlinuz()))
    return path
