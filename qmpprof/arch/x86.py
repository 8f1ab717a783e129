"""x86: the 64-bit instruction set (x86_64) and the 32-bit one (i386), as their psABIs number
the registers, with what the CPU pushes on a trap and what a code address can be.

DWARF numbers registers by the psABI: the return-address column, the stack and frame pointers
are 16, 7, 6 on x86_64 and 8, 4, 5 on i386. A trap from user mode (CPL 3) pushes SS, SP, FLAGS,
CS and IP, a word each: above the pc slot a user CS (RPL 3, a 16-bit selector) and FLAGS (bit 1
always set; the upper half zero on x86_64) tell such a frame from anything else. On x86_64 an
address is canonical when bits 63..47 are all equal; the kernel's half starts at
0xffff800000000000, and the default split puts the kernel at 0xffffffff80000000 (the mission's
convention), at 0xc0000000 (the 3 GiB / 1 GiB split of higher-half kernels) on i386.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qmpprof.arch.base import PathToCall, PrologueRule, ReadWord, ReturnRule
from qmpprof.arch.x86code import analyzer, branches, lone_jump, scanner
from qmpprof.arch.x86entry import path_to_call
from qmpprof.arch.x86scan import function_starts, is_call_before

_UPPER_HALF = 0xFFFF_8000_0000_0000


@dataclass(frozen=True, slots=True)
class X86:
    """One of the two x86 instruction sets (``X86_64``, ``I386``)."""

    name: str
    address_size: int
    pc: int
    sp: int
    fp: int
    names: tuple[str, ...]
    elf_machine: tuple[int, int]
    kernel_boundary: int
    shared_from: int
    space_register: str = "cr3"
    # i386 pushes ss:esp only when the privilege level changes; x86-64 always pushes rsp.
    same_level_trap_saves_sp: bool = True

    @property
    def mask(self) -> int:
        return (1 << (8 * self.address_size)) - 1

    @property
    def frame_record(self) -> tuple[int, int, int]:
        word = self.address_size
        return 0, word, 2 * word  # [rbp], [rbp + 8]: the pushed frame pointer, above it the call's

    @property
    def translation_registers(self) -> tuple[str, ...]:
        return ()  # the split is fixed: nothing in a return address depends on the guest

    @property
    def user_space_end(self) -> int | None:
        return None  # four or five levels of page tables: 2^47 or 2^56

    def translated(self, values: Mapping[str, int]) -> X86:
        return self

    def return_address(self, value: int) -> int | None:
        if self.address_size == 8 and _UPPER_HALF > value >= 1 << 47:
            return None  # not canonical: no code can be there
        return value if value <= self.mask else None

    def trap_frame_sp(self, after_pc: int, read: ReadWord) -> int | None:
        word, mask = self.address_size, self.mask
        cs = read(after_pc)
        flags = read((after_pc + word) & mask)
        if cs is None or flags is None or cs & 3 != 3 or cs > 0xFFFF or not flags & 2:
            return None
        if flags >> 32:
            return None
        return read((after_pc + 2 * word) & mask)

    def trap_return(self, slot: int, read: ReadWord) -> tuple[int, int] | None:
        # IP, CS, FLAGS, then SP and SS: always on x86_64, on i386 only from another privilege
        # level (the interrupted stack pointer is otherwise where the frame ends).
        word, mask = self.address_size, self.mask
        pc, cs, flags = (read((slot + i * word) & mask) for i in range(3))
        if pc is None or cs is None or flags is None or cs > 0xFFFF or not flags & 2:
            return None
        if flags >> 32:
            return None
        after = (slot + 3 * word) & mask
        if word == 4 and cs & 3 == 0:
            return pc, after
        sp = read(after)
        return None if sp is None else (pc, sp)

    def prologue(
        self,
        code: bytes,
        code_addr: int,
        pc: int,
        func_start: int | None,
        func_end: int | None = None,
    ) -> PrologueRule | None:
        return analyzer(self.address_size).analyze(code, code_addr, pc, func_start, func_end)

    def return_scan(self, code: bytes, code_addr: int, pc: int) -> ReturnRule | None:
        return scanner(self.address_size).scan(code, code_addr, pc)

    def return_from_entry(
        self, code: bytes, code_addr: int, pc: int, starts: Sequence[int], *, caller: bool
    ) -> ReturnRule | None:
        return scanner(self.address_size).from_entry(code, code_addr, pc, starts, caller=caller)

    def function_starts(self, code: bytes, code_addr: int, data: Sequence[bytes]) -> list[int]:
        return function_starts(code, code_addr, data, self.address_size)

    def is_call_before(self, code: bytes, ra: int) -> bool:
        return is_call_before(analyzer(self.address_size).cs, code, ra)

    def same_code(self, file: bytes, running: bytes) -> bool:
        return file == running

    def prepare(self) -> None:
        analyzer(self.address_size)  # built now, not inside the first pause that needs it

    def call_before(self, code: bytes, ra: int) -> int | None:
        # A direct call is e8 and a 32-bit displacement from the next instruction, on both.
        if len(code) < 5 or code[-5] != 0xE8:
            return None
        return (ra + int.from_bytes(code[-4:], "little", signed=True)) & self.mask

    def branches(self, code: bytes, addr: int) -> list[tuple[int, int | None]]:
        return branches(self.address_size, code, addr)

    def lone_jump(self, code: bytes, addr: int) -> tuple[int, int] | None:
        return lone_jump(self.address_size, code, addr)

    def path_to_call(self, code: bytes, code_addr: int, pc: int, target: int) -> PathToCall | None:
        return path_to_call(self.address_size, self.names, code, code_addr, pc, target)


# x86-64 psABI figure 3.36; i386 psABI (SCO numbering, as gcc and gdb use it).
X86_64 = X86(
    "x86_64", 8, pc=16, sp=7, fp=6,
    names=("rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp",
           "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip"),
    elf_machine=(62, 64),
    kernel_boundary=0xFFFF_FFFF_8000_0000,
    shared_from=_UPPER_HALF,
)  # fmt: skip
I386 = X86(
    "i386", 4, pc=8, sp=4, fp=5,
    names=("eax", "ecx", "edx", "ebx", "esp", "ebp", "esi", "edi", "eip"),
    elf_machine=(3, 32),
    kernel_boundary=0xC000_0000,
    shared_from=0xC000_0000,
    same_level_trap_saves_sp=False,
)  # fmt: skip
