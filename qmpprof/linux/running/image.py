"""The Linux kernel image as a ``Module`` of the running guest: its code at the KASLR slide,
unwound by its own tables where its platform has them (x86_64's ORC; without: its exception
code as the platform describes it, CFI, prologues and frame pointers), named by its functions,
and searched for tail-call frames in the image's code (``.text``: the running kernel's own
differs where boot-time patching changed it, not in its direct calls and jumps), its thunks and
trampolines told by the platform (``LinuxPlatform.target_kind``)."""

from __future__ import annotations

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.image import ElfImage
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.platform import LinuxPlatform
from qmpprof.model import Mapping
from qmpprof.unwind.space import Module
from qmpprof.unwind.steps import ExceptionEntry
from qmpprof.unwind.tailcall import CodeImage


def kernel_module(
    kernel: LinuxKernel,
    slide: int,
    arch: InstructionSet,
    platform: LinuxPlatform,
    entry: ExceptionEntry | None = None,
    *,
    lines: bool = False,
    debug: ElfImage | None = None,
) -> Module:
    """The kernel image as loaded at ``slide`` (runtime - link address); ``entry``: its
    exception code where the walk needs it described (arm64's, riscv64's);
    ``debug``: the image's debug file, whose DWARF gives the lines (else the image's own)."""
    low, high = kernel.span
    image = kernel.image
    mapping = Mapping(
        "vmlinux", low + slide, high + slide, True, slide, image.path, image.build_id, 0
    )
    own = tuple(platform.kernel_steps(kernel, slide, arch))
    text = image.text_bytes
    if not own:
        # Prologue answers are cached by the code: its hash now (bytes keep it), not in the
        # first pause that needs one (6 ms for arm64 6.1's 23 MB .text).
        hash(text)
    calls = CodeImage(image.text_addr, text, kernel.functions, platform.target_kind, arch, slide)
    return Module.build(
        mapping,
        arch,
        cfi=None if own else image.cfi,
        code=None if own else text,
        code_addr=image.text_addr,
        symbols=kernel.functions,
        lines=(debug or image).lines if lines else None,
        own=own,
        calls=calls if text else None,
        entry=entry,
    )
