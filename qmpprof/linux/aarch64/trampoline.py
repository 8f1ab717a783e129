"""What KPTI's trampoline says of the kernel it maps back, read from the kernel's code: how far
it moves TTBR1_EL1 to reach the kernel's own tables, and where it reads the kernel's vectors.

With KPTI (CONFIG_UNMAP_KERNEL_AT_EL0, on a CPU that Meltdown reaches), a vCPU at EL0 holds in
TTBR1_EL1 the trampoline's tables (``tramp_pg_dir``), which map nothing of the kernel but the
trampoline. Entered from EL0, the trampoline (``tramp_map_kernel``, arch/arm64/kernel/entry.S)
moves to the kernel's tables (``swapper_pg_dir``) with

    mrs  xT, ttbr1_el1
    add  xT, xT, #TRAMP_SWAPPER_OFFSET
    and  xT, xT, #~USER_ASID_FLAG        (``bic`` in the source)
    msr  ttbr1_el1, xT

so the kernel's tables lie ``TRAMP_SWAPPER_OFFSET`` bytes above the trampoline's. Every copy of
the sequence (one per vector) says the same on bookworm's 6.1 (0x2000: ``tramp_pg_dir``,
``reserved_pg_dir`` and ``swapper_pg_dir`` a page apart), whose kallsyms name neither table nor
``init_mm``.

A vCPU at EL0 also holds the trampoline's vectors in VBAR_EL1 (an alias at a fixed address,
not the kernel's ``vectors``). Each of their entries, once the kernel is mapped, loads the
kernel's vector base from a literal (``tramp_data_read_var xT, vectors``: ``ldr xT, =vectors``
in a kernel with KASLR; read through the kernel's tables, the trampoline's map no data) and
sets it (``msr vbar_el1, xT``): that literal, relocated at boot, is where the kernel put
``vectors`` (read so on bookworm's 6.1 at ``tramp_vectors+0x450``, booted on -cpu cortex-a57).
"""

from __future__ import annotations

import re

from qmpprof.arch.aarch64code import add_imm

_MRS_TTBR1 = re.compile(rb"\x20\x38\xd5")  # MRS Xt, TTBR1_EL1 but its first byte (0x20 | Xt)
_MSR_TTBR1 = 0xD518_2020  # MSR TTBR1_EL1, Xt
_OPCODE = 0xFF80_0000  # the bits that tell these 64-bit immediate forms apart
_ADD_IMM = 0x9100_0000  # ADD Xd, Xn, #imm{, LSL #12}
_AND_IMM = 0x9200_0000  # AND Xd, Xn, #bitmask
_PAGE = 0x1000
_LDR_LITERAL = 0x5800_0000  # LDR Xt, label (64-bit): imm19 in bits 23..5, mask 0xFF00_0000
_MSR_VBAR = 0xD518_C000  # MSR VBAR_EL1, Xt
_MASK = (1 << 64) - 1


def swapper_offset(code: bytes) -> int | None:
    """``TRAMP_SWAPPER_OFFSET`` as the sequence in ``code`` (the kernel's text) adds it; None
    when no such sequence is there (a kernel without KPTI) or its copies disagree."""
    found = set()
    for match in _MRS_TTBR1.finditer(code):
        at = match.start() - 1
        if at % 4 or at + 16 > len(code) or code[at] & 0xE0 != 0x20:
            continue
        mrs, add, clear, msr = (
            int.from_bytes(code[i : i + 4], "little") for i in range(at, at + 16, 4)
        )
        same = (mrs & 0x1F) * 0x21  # Xd = Xn = Xt: Rn in bits 9..5, Rd in 4..0
        if add & _OPCODE != _ADD_IMM or add & 0x3FF != same:
            continue
        if clear & _OPCODE != _AND_IMM or clear & 0x3FF != same or msr != _MSR_TTBR1 | mrs & 0x1F:
            continue
        found.add(add_imm(add))
    if len(found) != 1:
        return None
    offset = found.pop()
    return offset if offset and offset % _PAGE == 0 else None


def vectors_literal(code: bytes, addr: int) -> int | None:
    """The address of the literal the trampoline's vector entry ``code`` (at ``addr``) loads
    the kernel's vector base from: the ``ldr xT, <literal>`` whose register ``msr vbar_el1``
    then sets; None when the entry has no such pair (a kernel without KASLR computes it)."""
    loads: dict[int, int] = {}
    for i in range(0, len(code) - 3, 4):
        insn = int.from_bytes(code[i : i + 4], "little")
        if insn & 0xFF00_0000 == _LDR_LITERAL:
            offset = (insn >> 5) & 0x7_FFFF
            offset -= (offset & 0x4_0000) << 1
            loads[insn & 0x1F] = (addr + i + 4 * offset) & _MASK
        elif insn & 0xFFFF_FFE0 == _MSR_VBAR and insn & 0x1F in loads:
            return loads[insn & 0x1F]
    return None
