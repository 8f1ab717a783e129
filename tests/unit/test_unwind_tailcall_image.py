"""Tail-call frames (qmpprof.unwind.tailcall) over a real kernel's code: Debian unstable's arm64
7.2 Image, where issue 35 saw ``__pi_memset_generic <- __memset+0x8 <- sve_alloc`` and gdb
rightly has ``__pi_memset_generic <- sve_alloc``. The functions are found by their symbols and
the calls by reading the code, as the search itself does."""

from __future__ import annotations

from aarch64vm import image

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.linux.aarch64.running import AARCH64 as AARCH64_LINUX
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.unwind.tailcall import CodeImage, Outcome, TailCallFinder


def test_arm64_memset_is_crossed_never_made_a_frame() -> None:
    """memset is ``bti c; b __pi_memset_generic``, then the FEAT_MOPS variant boot-time patching
    makes its own on a CPU that has it: a walk from __pi_memset_generic to a caller of memset
    gets no frame between them."""
    linux = LinuxKernel.load(image("7"))
    code = CodeImage(
        linux.image.text_addr,
        linux.image.text_bytes,
        linux.functions,
        AARCH64_LINUX.target_kind,
        AARCH64,
    )
    memset = linux.symbols.address_of("memset")
    generic = linux.symbols.address_of("__pi_memset_generic")
    found = None if memset is None else code.function(memset)
    assert found is not None and generic is not None
    assert found[1] - found[0] > 8  # more code than the jump: the frame the issue saw was in it
    assert AARCH64.lone_jump(code.code(found[0], found[1]), found[0]) == (found[0] + 8, generic)
    caller = code.function(linux.symbols.address_of("sve_alloc") or 0)
    assert caller is not None
    body = code.code(caller[0], caller[1])
    returns = [
        caller[0] + at + 4
        for at in range(0, len(body), 4)
        if AARCH64.call_before(body[: at + 4], caller[0] + at + 4) == memset
    ]
    assert returns  # sve_alloc calls memset (the stack)
    finder = TailCallFinder([code])
    for ra in returns:
        chain = finder.between(ra, generic + 0x20)
        assert chain.outcome is Outcome.FOUND and chain.pcs == (), hex(ra)
