"""The Linux kernel image as a ``Module`` of the running guest: its code at the KASLR slide,
unwound by its ORC tables (its CFI, prologues and frame pointers without), named by its
functions."""

from __future__ import annotations

from qmpprof.arch.base import InstructionSet
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.model import Mapping
from qmpprof.unwind.orc import OrcCode
from qmpprof.unwind.space import Module


def kernel_module(
    kernel: LinuxKernel, slide: int, arch: InstructionSet, *, lines: bool = False
) -> Module:
    """The kernel image as loaded at ``slide`` (runtime - link address)."""
    low, high = kernel.span
    image = kernel.image
    mapping = Mapping(
        "vmlinux", low + slide, high + slide, True, slide, image.path, image.build_id, 0
    )
    orc = None if kernel.orc is None else OrcCode(kernel.orc, kernel.functions, kernel.thunks)
    return Module.build(
        mapping,
        arch,
        cfi=None if orc is not None else image.cfi,
        code=None if orc is not None else image.text_bytes,
        code_addr=image.text_addr,
        symbols=kernel.functions,
        lines=image.lines if lines else None,
        orc=orc,
    )
