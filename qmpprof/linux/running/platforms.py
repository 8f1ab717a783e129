"""The registry of running Linux's platforms, one per instruction set
(``platform.LinuxPlatform``): a new instruction set is a subpackage of ``qmpprof.linux`` and a
line below."""

from __future__ import annotations

from qmpprof.linux.aarch64.running import AARCH64
from qmpprof.linux.riscv64.running import RISCV64
from qmpprof.linux.running.platform import LinuxPlatform
from qmpprof.linux.x86_64.running import X86_64

PLATFORMS: tuple[LinuxPlatform, ...] = (X86_64, AARCH64, RISCV64)


def linux_platform(name: str) -> LinuxPlatform | None:
    """The platform of the instruction set ``name``; None where Linux is not read on it."""
    return next((p for p in PLATFORMS if p.name == name), None)
