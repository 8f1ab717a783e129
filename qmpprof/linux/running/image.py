"""The Linux kernel image as a ``Module`` of the running guest: its code at the KASLR slide,
unwound by its ORC tables (without: its exception code as ``entry.py`` describes it, CFI,
prologues and frame pointers), named by its functions, and searched for tail-call frames in the
image's code (``.text``: the running kernel's own differs where boot-time patching changed it,
not in its direct calls and jumps).

Which of its symbols are thunks and trampolines is a fact of the x86_64 kernel's naming, the
same from 5.10 to 7.3 once a 6.16+ startup-code alias's ``__pi_`` prefix is left out
(``linux.x86_64.orctables.unaliased``): ``__x86_indirect_*`` (``orctables.INDIRECT_THUNKS``:
the target is in a register), ``__x86_return_thunk``/``*untrain_ret`` (a ``ret``), ``__SCT__*``
(static-call trampolines: no DWARF, gdb stops there)."""

from __future__ import annotations

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.image import ElfImage
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.x86_64.orcstep import OrcCode, OrcStep
from qmpprof.linux.x86_64.orctables import INDIRECT_THUNKS, unaliased
from qmpprof.model import Mapping
from qmpprof.unwind.space import Module
from qmpprof.unwind.steps import ExceptionEntry
from qmpprof.unwind.tailcall import CodeImage, TargetKind


def kernel_module(
    kernel: LinuxKernel,
    slide: int,
    arch: InstructionSet,
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
    own: tuple[OrcStep, ...] = ()
    if kernel.orc is not None:
        own = (OrcStep(OrcCode(kernel.orc, kernel.functions, kernel.thunks), slide, arch),)
    text = image.text_bytes
    if not own:
        # Prologue answers are cached by the code: its hash now (bytes keep it), not in the
        # first pause that needs one (6 ms for arm64 6.1's 23 MB .text).
        hash(text)
    calls = CodeImage(image.text_addr, text, kernel.functions, target_kind, arch, slide)
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


def target_kind(name: str) -> TargetKind:
    """What a jump or call to the kernel symbol ``name`` means for the tail-call search."""
    name = unaliased(name)
    if name.startswith(INDIRECT_THUNKS):
        return TargetKind.INDIRECT
    if name.endswith(("return_thunk", "untrain_ret")):
        return TargetKind.RETURN
    if name.startswith("__SCT__"):
        return TargetKind.OPAQUE
    return TargetKind.FUNCTION
