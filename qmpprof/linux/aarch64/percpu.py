"""Where an arm64 kernel links its per-CPU area, ``__per_cpu_offset`` and ``__entry_task``, from
its own code, for the kernels whose kallsyms name no data symbol (bullseye's 5.10, bookworm's
6.1: no ``__per_cpu_start``, no ``__per_cpu_offset``, no ``__entry_task``).

The boot code that gives each CPU its offset, ``setup_per_cpu_areas`` (mm/percpu.c; 5.10's
drivers/base/arch_numa.c), says where both the area and the array are:

    delta = (unsigned long)pcpu_base_addr - (unsigned long)__per_cpu_start;
    for_each_possible_cpu(cpu)
        __per_cpu_offset[cpu] = delta + pcpu_unit_offsets[cpu];

compiled (5.10.0-30, 6.1.0-56, 7.3 alike) as

    adrp xS, __per_cpu_start ; add xS, xS, #0       adrp xA, __per_cpu_offset ; add xA, ...
    ldr  xB, [...]           ; sub xD, xB, xS       add xV, xU, xD ; str xV, [xA, wC, uxtw #3]

the address subtracted from a value loaded is the area's start; the array a value that adds
that difference is stored into at a CPU's index is ``__per_cpu_offset``. The function is init
code, in the Image and in kallsyms (it is freed only in the running kernel).

The current task's variable: arm64 keeps the current task in SP_EL0 while in the kernel;
entering from user mode, the vector's handler loads it from the per-CPU ``__entry_task``
(``ldr_this_cpu`` in entry.S's ``kernel_entry 0``, since 4.11):

    adrp xA, __entry_task            ; the page
    add  xA, xA, :lo12:__entry_task  ; the rest
    mrs  xT, tpidr_el1               ; this CPU's offset (tpidr_el2 under VHE)
    ldr  xD, [xA, xT]
    msr  sp_el0, xD

so the address ``adrp``/``add`` make in the handler (``el0t_64_sync``, ``el0_sync`` before
5.12) is the variable's: what a kernel whose BTF has no per-CPU variables (5.10's) needs.
"""

from __future__ import annotations

from qmpprof.arch.aarch64code import add_imm, adrp_page, is_adrp
from qmpprof.elf.image import ElfImage
from qmpprof.linux.symbols import KernelSymbols

_SETUP = "setup_per_cpu_areas"
_SETUP_SCAN = 0x400  # bytes followed to its first ret: ~0xc4 (5.10), ~0x15c (7.3)
_HANDLERS = ("el0t_64_sync", "el0_sync")  # the EL0 synchronous handler's names: 5.12+, before
_SCAN = 0x200  # bytes of the handler searched: the sequence sits ~0xb0 in (5.10 to 7.3)
_MASK = (1 << 64) - 1
_RET = 0xD65F_03C0
_CALL_CLOBBERED = range(19)  # x0-x18: a call leaves them unknown (x18 as the platform register)
# MRS/MSR's system-register fields (op0, op1, CRn, CRm, op2) as bits 20..5 of the instruction.
_TPIDR_EL1 = (3, 0, 13, 0, 4)
_TPIDR_EL2 = (3, 4, 13, 0, 2)
_SP_EL0 = (3, 0, 4, 1, 0)


def per_cpu_layout(image: ElfImage, symbols: KernelSymbols) -> tuple[int, int] | None:
    """(the per-CPU area's link address, ``__per_cpu_offset``'s), read from
    ``setup_per_cpu_areas`` (the module's docstring); None when it does not say."""
    start = symbols.address_of(_SETUP)
    at = None if start is None else start - image.text_addr
    if start is None or at is None or at < 0:
        return None
    return setup_areas(image.text_bytes[at : at + _SETUP_SCAN], start)


def setup_areas(code: bytes, addr: int) -> tuple[int, int] | None:
    """In ``code`` at ``addr``, up to its first ``ret``: (the address subtracted from a loaded
    value, the array that difference plus a value is stored into at an 8-byte index); None if
    there are not both. Branches are read straight through; a call forgets x0-x18."""
    made: dict[int, int] = {}  # register -> the address adrp/add made in it
    delta: set[int] = set()  # registers holding the difference, or a sum with it
    start = None
    for i in range(0, len(code) - 3, 4):
        insn = int.from_bytes(code[i : i + 4], "little")
        rd, rn, rm = insn & 0x1F, (insn >> 5) & 0x1F, (insn >> 16) & 0x1F
        if insn == _RET:
            break
        if insn >> 26 == 0b100101:  # BL
            for reg in _CALL_CLOBBERED:
                made.pop(reg, None)
                delta.discard(reg)
            continue
        if insn & 0xFFE0_0C00 == 0xF820_0800:  # STR (register), 64-bit
            if start is not None and rn in made and rd in delta and _scaled(insn):
                return start, made[rn]
            continue
        address, difference = None, False
        if is_adrp(insn):
            address = adrp_page(insn, addr + i)
        elif insn & 0xFF80_0000 == 0x9100_0000 and rn in made:  # ADD (immediate), 64-bit
            address = (made[rn] + add_imm(insn)) & _MASK
        elif insn & 0xFFE0_FC00 == 0xCB00_0000 and rm in made and rn not in made:  # SUB xD, xB, xS
            start, difference = made[rm], True
        elif insn & 0xFFE0_FC00 == 0x8B00_0000:  # ADD (shifted register), 64-bit, LSL #0
            difference = rn in delta or rm in delta
        made.pop(rd, None)
        delta.discard(rd)
        if address is not None:
            made[rd] = address
        if difference:
            delta.add(rd)
    return None


def _scaled(insn: int) -> bool:
    """A register-offset load or store's index shifted by 3 (UXTW, LSL or SXTW #3)."""
    return bool(insn >> 12 & 1) and (insn >> 13) & 7 in (0b010, 0b011, 0b110)


def entry_task_link(image: ElfImage, symbols: KernelSymbols) -> int | None:
    """``__entry_task``'s link address, read from the EL0 handler's code; None: not found."""
    for name in _HANDLERS:
        handler = symbols.address_of(name)
        if handler is None:
            continue
        at = handler - image.text_addr
        found = entry_task(image.text_bytes[at : at + _SCAN] if at >= 0 else b"", handler)
        if found is not None:
            return found
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
    if not is_adrp(adrp) or add & 0xFF80_0000 != 0x9100_0000:
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
    return (adrp_page(adrp, at) + add_imm(add)) & _MASK


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
