"""arm64 Linux's exception entry and exit code as the walk needs it (``unwind.entry.EntryCode``),
from the kernel's own description: its symbols (kallsyms) and the layout of ``pt_regs`` (BTF).

``arch/arm64/kernel/entry.S`` (the same from 5.12 to 6.12 at least): ``vectors`` is the 2 KiB
table of 16 entries of 0x80 bytes, by where the exception came from: the kernel with SP_EL0
(unused by Linux), the kernel with SP_ELx (+0x200: sync, irq, fiq, error), 64-bit user code
(+0x400), 32-bit user code (+0x600). An entry lowers sp by ``sizeof(pt_regs)`` and branches to
its handler, ``el1h_64_irq`` and kin for the kernel, ``el0t_64_sync`` and kin for user code;
``kernel_entry`` saves x0..x30, sp, ELR (the pc) and SPSR into ``pt_regs``, then stores the
frame record ``pt_regs.stackframe`` = {x29, ELR} (zeroed from user mode: the final record) and
points x29 at it. From user mode, until ``kernel_entry``'s stores are done, the user's x29 and
x30 are the CPU's, its pc in ELR_EL1 and its stack pointer in SP_EL0 (which then takes the
task): in the table's 64-bit user half (but at an entry's second instruction, where a
trampoline entered x30 holds its return until the entry takes the user's back from
TPIDRRO_EL0) and at the 64-bit user handlers' first instruction. ``ret_to_kernel`` and
``ret_to_user`` load it all back and ``eret``. A kernel without these symbols (x86_64's, unwound
by ORC) has none.
"""

from __future__ import annotations

from qmpprof.linux.btf import BtfError
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.unwind.entry import EntryCode, SavedFrame

ELR = 33  # ELR_mode in the DWARF for the Arm 64-bit Architecture
SP_EL0 = 0x1000  # the user stack pointer: no DWARF number, one of the walk's own
_TRAMPOLINE_X30 = 4  # an entry's instruction at which x30 is a trampoline's return
_KERNEL_HALF = (0x200, 0x400)  # of the vector table: from the kernel, SP_ELx
_USER_HALF = (0x400, 0x800)
_USER_64_END = 0x600  # the user half's 64-bit entries end there
_ENTRY_SIZE = 0x80
_KINDS = ("sync", "irq", "fiq", "error")
_FROM_USER = {f"el0t_{bits}_{kind}" for bits in (64, 32) for kind in _KINDS} | {"ret_to_user"}
_UNSAVED = {f"el0t_64_{kind}" for kind in _KINDS}  # at their first instruction
_FROM_KERNEL = {f"el1h_64_{kind}" for kind in _KINDS}
_BACK_TO_KERNEL = {"ret_to_kernel"}


def entry_code(kernel: LinuxKernel) -> EntryCode | None:
    """The kernel's exception code, None when its symbols or BTF do not describe it."""
    vectors = kernel.symbols.address_of("vectors")
    if vectors is None or kernel.btf is None:
        return None
    btf = kernel.btf
    try:
        frame = SavedFrame(
            regs=btf.offset_of("pt_regs.regs"),
            count=31,
            sp=btf.offset_of("pt_regs.sp"),
            pc=btf.offset_of("pt_regs.pc"),
            status=btf.offset_of("pt_regs.pstate"),
            record=btf.offset_of("pt_regs.stackframe"),
            size=btf.size_of(btf.struct("pt_regs").id),
        )
    except (KeyError, BtfError):
        return None
    spans: dict[str, list[tuple[int, int]]] = {"user": [], "saving": [], "restoring": []}
    wanted = {name: "user" for name in _FROM_USER}
    wanted |= {name: "saving" for name in _FROM_KERNEL}
    wanted |= {name: "restoring" for name in _BACK_TO_KERNEL}
    unsaved = []
    for start, end, name in kernel.functions.items():
        if name in wanted:
            spans[wanted[name]].append((start, end))
        if name in _UNSAVED:
            unsaved.append((start, start + 4))
    for entry in range(vectors + _USER_HALF[0], vectors + _USER_64_END, _ENTRY_SIZE):
        unsaved += [(entry, entry + _TRAMPOLINE_X30), (entry + 8, entry + _ENTRY_SIZE)]
    if len(spans["saving"]) != len(_FROM_KERNEL):
        return None  # not the entry code this module knows
    spans["user"].append((vectors + _USER_HALF[0], vectors + _USER_HALF[1]))
    low, high = vectors + _KERNEL_HALF[0], vectors + _KERNEL_HALF[1]
    return EntryCode(
        user=tuple(spans["user"]),
        vectors=(low, high),
        entries=tuple(range(low, high, _ENTRY_SIZE)),
        saving=tuple(spans["saving"]),
        restoring=tuple(spans["restoring"]),
        frame=frame,
        link=ELR,
        unsaved=tuple(unsaved),
        user_sp=SP_EL0,
    )
