"""Where an arm64 kernel links its per-CPU area, from its own code when kallsyms names no data
symbol (bookworm's 6.1: no ``__per_cpu_start``, no ``__entry_task``).

arm64 Linux keeps the current task in SP_EL0 while in the kernel; entering from user mode, the
vector's handler loads it from the per-CPU variable ``__entry_task`` (``ldr_this_cpu`` in
entry.S's ``kernel_entry 0``, since 4.11):

    adrp xA, __entry_task            ; the page
    add  xA, xA, :lo12:__entry_task  ; the rest
    mrs  xT, tpidr_el1               ; this CPU's offset (tpidr_el2 under VHE)
    ldr  xD, [xA, xT]
    msr  sp_el0, xD

so the address ``adrp``/``add`` make in the handler (``el0t_64_sync``, ``el0_sync`` before
5.12) is the variable's, and minus its offset in BTF's ``.data..percpu`` it is the area's
start. The same sequence read on 6.1.0-56 (0xffff800009804308, the area at ...804000) and on
6.12.117, where kallsyms' own ``__entry_task`` and ``__per_cpu_start`` agree.
"""

from __future__ import annotations

from qmpprof.elf.image import ElfImage
from qmpprof.linux.btf import Btf
from qmpprof.linux.symbols import KernelSymbols

_HANDLERS = ("el0t_64_sync", "el0_sync")  # the EL0 synchronous handler's names: 5.12+, before
_SCAN = 0x200  # bytes of the handler searched: the sequence sits ~0xb0 in (6.1, 6.12)
_MASK = (1 << 64) - 1
# MRS/MSR's system-register fields (op0, op1, CRn, CRm, op2) as bits 20..5 of the instruction.
_TPIDR_EL1 = (3, 0, 13, 0, 4)
_TPIDR_EL2 = (3, 4, 13, 0, 2)
_SP_EL0 = (3, 0, 4, 1, 0)


def per_cpu_area(image: ElfImage, symbols: KernelSymbols, btf: Btf) -> int | None:
    """The link address of the per-CPU area: ``__entry_task``'s, read from the EL0 handler's
    code, less its offset in BTF (None: no handler, no such sequence, or no such variable)."""
    try:
        offset = btf.percpu("__entry_task")[0]
    except KeyError:
        return None
    for name in _HANDLERS:
        handler = symbols.address_of(name)
        if handler is None:
            continue
        at = handler - image.text_addr
        found = entry_task(image.text_bytes[at : at + _SCAN] if at >= 0 else b"", handler)
        if found is not None:
            return found - offset
    return None


def entry_task(code: bytes, handler: int) -> int | None:
    """The link address of the variable the EL0 handler at ``handler`` (``code``: its first
    bytes) loads into SP_EL0; None if not found."""
    words = [int.from_bytes(code[i : i + 4], "little") for i in range(0, len(code) - 3, 4)]
    for i in range(4, len(words)):
        if _msr(words[i]) != (_SP_EL0, words[i - 1] & 0x1F):
            continue
        found = _per_cpu_load(words[i - 4 : i], handler + 4 * (i - 4))
        if found is not None:
            return found
    return None


def _per_cpu_load(words: list[int], at: int) -> int | None:
    """``adrp; add; mrs tpidr; ldr [xA, xT]`` at ``at``: the address ``adrp``/``add`` make."""
    adrp, add, mrs, ldr = words
    if adrp & 0x9F00_0000 != 0x9000_0000 or add & 0xFF80_0000 != 0x9100_0000:
        return None
    base = adrp & 0x1F
    if (add >> 5) & 0x1F != base or add & 0x1F != base:
        return None
    read = _mrs(mrs)
    if read is None or read[0] not in (_TPIDR_EL1, _TPIDR_EL2):
        return None
    # LDR Xt, [Xn, Xm] (64-bit, register offset, LSL #0): Xn the address, Xm the offset.
    if ldr & 0xFFE0_FC00 != 0xF860_6800 or (ldr >> 5) & 0x1F != base:
        return None
    if (ldr >> 16) & 0x1F != read[1]:
        return None
    page = ((adrp >> 29) & 3 | ((adrp >> 5) & 0x7_FFFF) << 2) << 12
    if page >> 32:
        page -= 1 << 33  # a signed 33-bit offset
    shift = 12 if add >> 22 & 1 else 0
    return ((at & ~0xFFF) + page + (((add >> 10) & 0xFFF) << shift)) & _MASK


def _mrs(insn: int) -> tuple[tuple[int, ...], int] | None:
    return _sysreg(insn, 0xD530_0000)


def _msr(insn: int) -> tuple[tuple[int, ...], int] | None:
    return _sysreg(insn, 0xD510_0000)


def _sysreg(insn: int, kind: int) -> tuple[tuple[int, ...], int] | None:
    """(the system register's fields, the general register) of an MRS/MSR (register form)."""
    if insn & 0xFFF0_0000 != kind:
        return None
    fields = (2 + (insn >> 19 & 1), insn >> 16 & 7, insn >> 12 & 15, insn >> 8 & 15, insn >> 5 & 7)
    return fields, insn & 0x1F
