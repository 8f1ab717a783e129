"""The registry of Linux's kernel-file platforms, one per instruction set
(``platform.KernelFilePlatform``): a new instruction set is a subpackage and a line below."""

from __future__ import annotations

from qmpprof.linux.aarch64.kernelfile import AARCH64_FILE
from qmpprof.linux.platform import KernelFilePlatform
from qmpprof.linux.riscv64.kernelfile import RISCV64_FILE
from qmpprof.linux.x86_64.kernelfile import X86_64_FILE

KERNEL_FILES: tuple[KernelFilePlatform, ...] = (X86_64_FILE, AARCH64_FILE, RISCV64_FILE)


def kernel_file(name: str) -> KernelFilePlatform | None:
    """The platform of the instruction set ``name``; None where Linux is not read on it."""
    return next((p for p in KERNEL_FILES if p.name == name), None)


def boot_image(head: bytes) -> KernelFilePlatform | None:
    """The platform whose boot image a file starting with ``head`` is; None (an ELF, or not a
    kernel)."""
    return next((p for p in KERNEL_FILES if p.is_boot_image(head)), None)
