"""The instruction sets qmpprof reads, as DWARF sees them: register numbers and address size.

DWARF names registers by number, and the numbers depend on the architecture's psABI: the
return-address column, the stack and frame pointers are 16, 7, 6 on x86_64 and 8, 4, 5 on i386.
The address size is what an absolute pointer (DW_EH_PE_absptr, DW_OP_addr, DW_OP_deref, a
.debug_frame initial location) occupies, and the width of a stack word.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Arch:
    """One instruction set: ``pc``, ``sp`` and ``fp`` are DWARF register numbers; ``names``
    gives each DWARF number up to ``pc`` its register's name."""

    name: str
    address_size: int
    pc: int
    sp: int
    fp: int
    names: tuple[str, ...]

    @property
    def mask(self) -> int:
        """All address bits set: arithmetic on addresses wraps at this width."""
        return (1 << (8 * self.address_size)) - 1


# x86-64 psABI figure 3.36; i386 psABI (SCO numbering, as gcc and gdb use it).
X86_64 = Arch(
    "x86_64", 8, pc=16, sp=7, fp=6,
    names=("rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp",
           "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip"),
)  # fmt: skip
I386 = Arch(
    "i386", 4, pc=8, sp=4, fp=5,
    names=("eax", "ecx", "edx", "ebx", "esp", "ebp", "esi", "edi", "eip"),
)  # fmt: skip

# ELF e_machine (as pyelftools spells it) and class -> Arch.
BY_MACHINE: dict[tuple[str, int], Arch] = {("EM_X86_64", 64): X86_64, ("EM_386", 32): I386}
