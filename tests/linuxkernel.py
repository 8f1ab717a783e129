"""The Debian kernel the linux tests read: fetched by scripts/fetch-linux, unpacked once."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

from qmpprof.elf.image import ElfImage
from qmpprof.linux.bzimage import vmlinux_bytes

ROOT = Path(__file__).resolve().parent.parent
LINUX_DIR = ROOT / "fixtures" / "build" / "linux"


@cache
def linux_dir() -> Path:
    """fixtures/build/linux with vmlinuz, config, System.map and version (fetched if missing)."""
    subprocess.run([ROOT / "scripts" / "fetch-linux"], check=True, stdin=subprocess.DEVNULL)
    return LINUX_DIR


@cache
def vmlinux() -> ElfImage:
    """The vmlinux ELF unpacked from the fixture's bzImage."""
    path = linux_dir() / "vmlinuz"
    return ElfImage.from_bytes(str(path), vmlinux_bytes(path.read_bytes(), str(path)))
