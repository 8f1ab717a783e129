"""The initial task and the size of a task's kernel stack, read from an arm64 kernel's own boot
code when kallsyms names no data symbol (bookworm's 6.1: no ``init_task``, no ``init_stack``).

``__primary_switched`` (arch/arm64/kernel/head.S, 5.x to 6.12 at least) starts the boot CPU's
first task, ``init_task``, with ``init_cpu_task``:

    adrp xT, init_task ; add xT, xT, :lo12:init_task
    msr  sp_el0, xT                     ; the current task
    ldr  xS, [xT, #TSK_STACK]           ; task_struct.stack: init_stack
    add  sp, xS, #THREAD_SIZE           ; the top of its stack

so the address put in SP_EL0 there is ``init_task``'s, and the immediate added to its
``stack`` (the load's offset checked against BTF) is ``THREAD_SIZE``. Read the same on
6.1.0-56 (0x4000, ``init_task`` at 0xffff800009cc8dc0) and 6.12.117, where kallsyms'
``init_task`` agrees.
"""

from __future__ import annotations

from qmpprof.arch.aarch64code import add_imm, adrp_page, is_adrp
from qmpprof.elf.image import ElfImage
from qmpprof.linux.btf import Btf
from qmpprof.linux.platform import BootTask
from qmpprof.linux.symbols import KernelSymbols

_ENTRY = "__primary_switched"
_SCAN = 0x40  # bytes read of it: the sequence ends ~0x14 in
_MASK = (1 << 64) - 1
_SP = 31
_MSR_SP_EL0 = 0xD518_4100  # MSR SP_EL0, Xt (Xt in bits 4..0)


def boot_task(image: ElfImage, symbols: KernelSymbols, btf: Btf) -> BootTask | None:
    """What ``__primary_switched`` says (the module's docstring); None when it is not there or
    does not read as expected."""
    start = symbols.address_of(_ENTRY)
    try:
        stack = btf.offset_of("task_struct.stack")
    except KeyError:
        return None
    if start is None or start < image.text_addr:
        return None
    at = start - image.text_addr
    return read_boot_task(image.text_bytes[at : at + _SCAN], start, stack)


def read_boot_task(code: bytes, addr: int, stack_offset: int) -> BootTask | None:
    """The sequence in ``code`` at ``addr``; ``stack_offset``: ``task_struct.stack``'s."""
    made: dict[int, int] = {}  # register -> the address adrp/add made in it
    task = stack = None  # the register holding init_task, its stack
    for i in range(0, len(code) - 3, 4):
        insn = int.from_bytes(code[i : i + 4], "little")
        rd, rn = insn & 0x1F, (insn >> 5) & 0x1F
        imm = add_imm(insn)
        if is_adrp(insn):
            made[rd] = adrp_page(insn, addr + i)
        elif insn & 0xFF80_0000 == 0x9100_0000 and rn in made and rd != _SP:  # ADD (imm)
            made[rd] = (made[rn] + imm) & _MASK
        elif insn & 0xFFFF_FFE0 == _MSR_SP_EL0 and rd in made:
            task = rd
        elif insn & 0xFFC0_0000 == 0xF940_0000 and task is not None and rn == task:  # LDR
            if ((insn >> 10) & 0xFFF) * 8 == stack_offset:
                stack = rd
        elif insn & 0xFF80_0000 == 0x9100_0000 and rd == _SP and rn == stack:
            # ADD sp, xS, #THREAD_SIZE: a power of two
            found = task is not None and imm and imm & (imm - 1) == 0
            return BootTask(made[task], imm) if found and task is not None else None
    return None
