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

Each CPU's offset into that area is ``__per_cpu_offset[cpu]`` (what TPIDR_EL1 holds), which a
transport without system registers (QMP) must read in memory. The scheduler's ``idle_cpu(cpu)``
(also ``available_idle_cpu``, ``nr_iowait_cpu``: ``cpu_rq(cpu)``) says where that array is:

    adrp xA, __per_cpu_offset ; add xA, ...   adrp xR, runqueues ; add xR, ...
    ldr  xO, [xA, w0, sxtw #3]                add  xR, xR, xO

the array a CPU number indexes whose element is added to ``runqueues``' address (checked
against BTF's offset of that per-CPU variable). Read the same way on 6.1.0-56 and 6.12.117,
where it is kallsyms' ``__per_cpu_offset``.
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


_INDEXERS = ("idle_cpu", "available_idle_cpu", "nr_iowait_cpu")  # cpu_rq(cpu) users
_INDEXER_SCAN = 0x40


def per_cpu_offsets(image: ElfImage, symbols: KernelSymbols, btf: Btf, area: int) -> int | None:
    """The link address of ``__per_cpu_offset``, read from the scheduler's code (the module's
    docstring); None if no such function reads it as expected."""
    try:
        runqueues = (area + btf.percpu("runqueues")[0]) & _MASK
    except KeyError:
        return None
    for name in _INDEXERS:
        start = symbols.address_of(name)
        at = None if start is None else start - image.text_addr
        if start is None or at is None or at < 0:
            continue
        found = indexed_array(image.text_bytes[at : at + _INDEXER_SCAN], start, runqueues)
        if found is not None:
            return found
    return None


def indexed_array(code: bytes, addr: int, variable: int) -> int | None:
    """In ``code`` at ``addr``: the address of an array of 8-byte offsets loaded at an index
    (``ldr xO, [xA, wI, sxtw #3]`` or ``[xA, xI, lsl #3]``) and added to ``variable``'s
    address, both made by ``adrp``/``add``; None if there is no such sequence."""
    made: dict[int, int] = {}  # register -> the address adrp/add made in it
    loaded: dict[int, int] = {}  # register -> the array its value was loaded from
    for i in range(0, len(code) - 3, 4):
        insn = int.from_bytes(code[i : i + 4], "little")
        here = addr + i
        rd, rn = insn & 0x1F, (insn >> 5) & 0x1F
        if insn & 0x9F00_0000 == 0x9000_0000:  # ADRP
            made[rd] = adrp_page(insn, here)
        elif insn & 0xFF80_0000 == 0x9100_0000 and rn in made:  # ADD (immediate), 64-bit
            shift = 12 if insn >> 22 & 1 else 0
            made[rd] = (made[rn] + (((insn >> 10) & 0xFFF) << shift)) & _MASK
        elif insn & 0xFFE0_0C00 == 0xF860_0800 and rn in made:  # LDR (register), 64-bit
            option, scaled = (insn >> 13) & 7, insn >> 12 & 1
            if scaled and option in (0b011, 0b110):  # LSL #3 or SXTW #3
                loaded[rd] = made[rn]
        elif insn & 0xFFE0_FC00 == 0x8B00_0000:  # ADD (shifted register), 64-bit, LSL #0
            rm = (insn >> 16) & 0x1F
            for base, offset in ((rn, rm), (rm, rn)):
                if made.get(base) == variable and offset in loaded:
                    return loaded[offset]
    return None


def adrp_page(insn: int, at: int) -> int:
    """The address of the 4 KiB page the ADRP instruction ``insn`` at ``at`` makes."""
    page = ((insn >> 29) & 3 | ((insn >> 5) & 0x7_FFFF) << 2) << 12
    if page >> 32:
        page -= 1 << 33  # a signed 33-bit offset
    return ((at & ~0xFFF) + page) & _MASK


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
    shift = 12 if add >> 22 & 1 else 0
    return (adrp_page(adrp, at) + (((add >> 10) & 0xFFF) << shift)) & _MASK


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
