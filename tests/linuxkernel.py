"""The Debian kernels the linux tests read: fetched by scripts/fetch-linux, unpacked once.

6.12 (zstd, the 6.9 table order) is the project's Linux fixture; 6.1 (xz, the old order with
seqs of names between markers and tokens) and bullseye's 5.10 (xz, no seqs of names, BTF
without variables) are there for the readers of kernel images, and unstable's 7.x (zstd;
Debian's newest when fetched: kallsyms 4-aligned with self-relative offsets, per-CPU symbols
that are ordinary data, ORC registers renumbered). Every one is read (``SERIES``) and booted
(``BOOTED``) by the tests.
"""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

from qmpprof.elf.image import ElfImage
from qmpprof.linux.bzimage import vmlinux_bytes

ROOT = Path(__file__).resolve().parent.parent
SERIES = ("6.12", "6.1", "5.10", "7")
BOOTED = SERIES  # every series the test guest boots (scripts/linux-series.sh)
_DIRS = {"6.12": "linux", "6.1": "linux-6.1", "5.10": "linux-5.10", "7": "linux-7"}


@cache
def linux_dir(series: str = "6.12") -> Path:
    """The folder with vmlinuz, config, System.map and version (fetched if missing)."""
    fetch = ROOT / "scripts" / "fetch-linux"
    subprocess.run([fetch, series], check=True, stdin=subprocess.DEVNULL)
    return ROOT / "fixtures" / "build" / _DIRS[series]


@cache
def vmlinux(series: str = "6.12") -> ElfImage:
    """The vmlinux ELF unpacked from the series' bzImage."""
    path = linux_dir(series) / "vmlinuz"
    return ElfImage.from_bytes(str(path), vmlinux_bytes(path.read_bytes(), str(path)))
