"""riscv64 (RV64GC), as its DWARF numbers the registers, with the frame records the walk falls back
on and the address-space halves the guest's satp sets.

DWARF (the RISC-V ELF psABI) numbers x0..x31 as 0..31 and f0..f31 as 32..63; it gives the pc no
number (a CIE's return-address column is ra, x1): qmpprof holds it at 64, past every psABI
register. sp is x2, the frame pointer s0 is x8. A frame record is two words just below the frame
pointer, which is the caller's stack pointer: the caller's s0 at s0 - 16, the return address at
s0 - 8 (GCC's layout, Linux's ``struct stackframe`` on riscv).

satp's mode (bits 63..60: 8 Sv39, 9 Sv48, 10 Sv57; 0: no translation) sets the virtual address
size: an address is valid when its bits above it are copies of its top bit, the lower half being
user space. Without satp the widest (Sv57) bounds what a return address can be. Code at or above
2^63 is the kernel's whatever the mode.

The CPU pushes nothing on a trap: it saves the pc in sepc and the kernel saves the rest itself (in
Linux's pt_regs), so there is no CPU trap frame to recognise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from qmpprof.arch.base import FrameRecordsOnly, PrologueRule
from qmpprof.arch.riscv64code import PROLOGUES, RA, decode, is_call, is_return, length, word

_MASK = (1 << 64) - 1
_UPPER_HALF = 1 << 63
SATP_MODES = {8: 39, 9: 48, 10: 57}  # satp.MODE -> virtual-address bits (privileged ISA 10.1.11)
_WIDEST = 57
_C_NOP, _NOP_HALVES = b"\x01\x00", (b"\x13\x00", b"\x00\x00")  # c.nop; nop's two halves


def _j_or_nop(code: bytes) -> bool:
    """Whether ``code`` is one of the 4-byte forms a boot-time patch swaps: ``nop`` or ``j``
    (jal x0, any offset)."""
    if len(code) != 4:
        return False
    insn = int.from_bytes(code, "little")
    return insn == 0x13 or insn & 0xFFF == 0x6F


def va_bits(satp: int) -> int | None:
    """The virtual-address size satp's mode sets; None: bare (no translation) or unknown."""
    return SATP_MODES.get(satp >> 60)


@dataclass(frozen=True, slots=True)
class RiscV64(FrameRecordsOnly):
    """The riscv64 instruction set; ``bits`` is the virtual-address size the guest's satp sets
    (``translated``), None while it is not known."""

    bits: int | None = None
    name: str = "riscv64"
    address_size: int = 8
    pc: int = 64
    sp: int = 2
    fp: int = 8
    names: tuple[str, ...] = (*(f"x{n}" for n in range(32)), *(f"f{n}" for n in range(32)), "pc")
    elf_machine: tuple[int, int] = (243, 64)  # EM_RISCV, ELFCLASS64
    kernel_boundary: int = _UPPER_HALF
    shared_from: int = _UPPER_HALF
    space_register: str = "satp"
    mask: int = _MASK
    frame_record: tuple[int, int, int] = (-16, -8, 0)
    same_level_trap_saves_sp: bool = True  # the CPU pushes nothing: the kernel saves it all

    @property
    def translation_registers(self) -> tuple[str, ...]:
        return ("satp",)

    @property
    def user_space_end(self) -> int | None:
        return None if self.bits is None else 1 << (self.bits - 1)

    def translated(self, values: Mapping[str, int]) -> RiscV64:
        """Under satp's mode (as QEMU's gdbstub reports it) the halves are that mode's; bare or
        without satp, this one."""
        satp = values.get("satp")
        bits = None if satp is None else va_bits(satp)
        return self if bits is None else dataclasses.replace(self, bits=bits)

    def return_address(self, value: int) -> int | None:
        if value > _MASK or value < 0:
            return None
        half = 1 << ((self.bits or _WIDEST) - 1)
        return value if value < half or value >= (1 << 64) - half else None

    def prologue(
        self,
        code: bytes,
        code_addr: int,
        pc: int,
        func_start: int | None,
        func_end: int | None = None,
    ) -> PrologueRule | None:
        return PROLOGUES.analyze(code, code_addr, pc, func_start, func_end)

    def is_call_before(self, code: bytes, ra: int) -> bool:
        # A call is 4 bytes (jal, jalr) or 2 (c.jalr): either may end right before ra.
        for size in (4, 2):
            insn = word(code, len(code) - size) if len(code) >= size else None
            if insn is not None and length(code, len(code) - size) == size:
                kind, rd, _, _ = decode(insn)
                if is_call(kind, rd):
                    return True
        return False

    def same_code(self, file: bytes, running: bytes) -> bool:
        # Linux patches code at boot: ftrace turns each function's four c.nop into two nop
        # (every function entry of trixie's 6.12 differs from the file so), its alternatives
        # and static keys swap a j and a nop (``riscv_clock_next_event``'s j over
        # ``csrw stimecmp`` is a nop where the CPU has Sstc). Halfword by halfword, as a place
        # may cut a nop in two: a c.nop may hold either half of a nop; a j and a nop, whole,
        # either one the other.
        if len(file) != len(running) or len(file) % 2:
            return file == running
        at = 0
        while at < len(file):
            was, now = file[at : at + 2], running[at : at + 2]
            if was == now or (was == _C_NOP and now in _NOP_HALVES):
                at += 2
            elif _j_or_nop(file[at : at + 4]) and _j_or_nop(running[at : at + 4]):
                at += 4
            else:
                return False
        return True

    def call_before(self, code: bytes, ra: int) -> int | None:
        # jal ra, offset; or the far call auipc ra, hi20 + jalr ra, lo12(ra).
        if len(code) < 4 or code[-4] & 3 != 3:
            return None
        kind, rd, rs1, imm = decode(int.from_bytes(code[-4:], "little"))
        if kind == "jal" and rd == RA:
            return (ra - 4 + imm) & _MASK
        if kind != "jalr" or rd != RA or rs1 != RA or len(code) < 8:
            return None
        auipc = int.from_bytes(code[-8:-4], "little")
        if auipc & 0xFFF != 0x17 | RA << 7:  # auipc ra
            return None
        hi = auipc & 0xFFFF_F000
        return (ra - 8 + hi - ((hi & 0x8000_0000) << 1) + imm) & _MASK

    def branches(self, code: bytes, addr: int) -> list[tuple[int, int | None]]:
        out: list[tuple[int, int | None]] = []
        at = 0
        while at + 2 <= len(code):
            insn = word(code, at)
            if insn is None:
                break
            size = length(code, at)
            kind, rd, rs1, imm = decode(insn)
            here = addr + at
            if kind in ("jal", "branch") and rd == 0:
                out.append((here + size, (here + imm) & _MASK))
            elif kind == "jalr" and rd == 0 and not is_return(kind, rd, rs1, imm):
                out.append((here + size, None))
            at += size
        return out

    def lone_jump(self, code: bytes, addr: int) -> tuple[int, int] | None:
        at = 0
        while at + 2 <= len(code):
            insn = word(code, at)
            if insn is None:
                return None
            kind, rd, _, imm = decode(insn)
            if kind == "jal" and rd == 0:  # j, c.j
                return addr + at + length(code, at), (addr + at + imm) & _MASK
            if kind not in ("addi", "write") or rd != 0:  # a write to x0 is a no-op (nop)
                return None
            at += length(code, at)
        return None


RISCV64 = RiscV64()
