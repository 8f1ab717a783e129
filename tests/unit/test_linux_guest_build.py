"""The Linux test guest's build (scripts/build-linux-guest): its outputs, and the initramfs writer
giving a cpio newc archive back as built (the guest booted: tests/e2e/test_linux_boot.py)."""

from __future__ import annotations

import gzip
import importlib.util
import stat
from pathlib import Path
from types import ModuleType

import pytest
from elftools.elf.elffile import ELFFile
from linuxkernel import BOOTED, linux_dir
from linuxvm import (
    LIBLZMA,
    MODULE_KO,
    ROOT,
    WORK_ELF,
    XZ,
    build_linux_guest,
    module_ko,
)

from qmpprof.elf.image import ElfImage


@pytest.mark.linux
def test_build_outputs() -> None:
    """The workload program keeps .eh_frame and a build-id; the module carries ORC tables, for
    every kernel fetched; Debian's xz is a PIE (ET_DYN with an interpreter) and liblzma keeps
    its .eh_frame (both stripped of .symtab: only dynamic symbols name their code)."""
    build_linux_guest()
    work = ElfImage.load(WORK_ELF)
    assert work.section(".eh_frame")
    assert work.build_id
    releases = [(linux_dir(s) / "version").read_text().strip() for s in BOOTED]
    for ko in [MODULE_KO, *map(module_ko, releases)]:
        module = ElfImage.load(ko)
        assert module.section(".orc_unwind") and module.section(".orc_unwind_ip"), ko
    with XZ.open("rb") as f:
        xz = ELFFile(f)
        assert xz.header.e_type == "ET_DYN"
        assert any(seg.header.p_type == "PT_INTERP" for seg in xz.iter_segments())
    assert LIBLZMA.is_symlink() and LIBLZMA.resolve().parent == LIBLZMA.parent.resolve()
    lzma = ElfImage.load(LIBLZMA.resolve())
    assert lzma.section(".eh_frame") and lzma.section(".eh_frame_hdr")
    assert lzma.section(".symtab") is None and lzma.build_id


def mkinitramfs() -> ModuleType:
    path = ROOT / "fixtures" / "linux-guest" / "mkinitramfs.py"
    spec = importlib.util.spec_from_file_location("mkinitramfs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_newc(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """name -> (mode, data, (rdev major, minor)) of a cpio newc archive, up to its trailer."""
    entries: dict[str, tuple[int, bytes, tuple[int, int]]] = {}
    pos = 0
    while True:
        assert data[pos : pos + 6] == b"070701"
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rdev, namesize = fields[1], fields[6], (fields[9], fields[10]), fields[11]
        name_end = pos + 110 + namesize
        name = data[pos + 110 : name_end - 1].decode()
        start = name_end + (-name_end % 4)
        if name == "TRAILER!!!":
            return entries
        entries[name] = (mode, data[start : start + size], rdev)
        pos = start + size + (-(start + size) % 4)


def test_mkinitramfs_writes_newc(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\n")
    (root / "bin" / "tool").chmod(0o755)
    (root / "bin" / "sh").symlink_to("tool")
    (root / "odd").write_bytes(b"abc")
    out = tmp_path / "initramfs.cpio.gz"
    assert mkinitramfs().main([str(out), str(root), "--node", "/dev/console:c:5:1"]) == 0
    entries = read_newc(gzip.decompress(out.read_bytes()))
    assert list(entries) == ["bin", "bin/sh", "bin/tool", "odd", "dev/console"]
    assert stat.S_ISDIR(entries["bin"][0])
    assert stat.S_ISLNK(entries["bin/sh"][0]) and entries["bin/sh"][1] == b"tool"
    assert entries["bin/tool"][:2] == (stat.S_IFREG | 0o755, b"#!/bin/sh\n")
    assert entries["odd"][1] == b"abc"
    assert entries["dev/console"] == (stat.S_IFCHR | 0o600, b"", (5, 1))
