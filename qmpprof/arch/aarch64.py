"""aarch64 (ARMv8-A, 64-bit), as its DWARF numbers the registers, with what a code address can be
under pointer authentication and the frame records (x29, x30) the walk falls back on.

DWARF (the Arm DWARF supplement for AArch64) numbers x0..x30 as 0..30, sp as 31 and the pc as
32; x29 is the frame pointer, x30 the link register (a function's return address, the CIE's
return-address column). A frame record is two words: the caller's x29, then the return address;
the caller's frame pointer points at the caller's record, as on x86 ([fp], [fp + 8]).

Bit 55 of a virtual address selects the translation regime's half (TTBR1, the kernel's, when
set): code at or above 0xff80000000000000 is the kernel's whatever the sizes of the halves. With
pointer authentication (``-cpu max``, Linux's CONFIG_ARM64_PTR_AUTH_KERNEL) a saved return
address carries a code in the bits above the half's virtual-address size (64 - TCR_EL1.TnSZ) but
bit 55: x30 read 0xafe5a735938d5ac4 where the code is at 0xffffa735938d5ac4 (bookworm's 6.1,
T1SZ 16). Stripping it (what XPACI does) copies bit 55 into those bits. Only the guest's own
translation settings give the sizes (``translated``); without them a return address must already
be in its plain form (bits 63..55 all equal, or a lower-half address below 2^48 — the smallest
size Linux uses on any page size).

The CPU pushes nothing on an exception: the kernel saves the interrupted state itself, so there
is no CPU trap frame to recognise (Linux's pt_regs ends in a frame record whose return address is
the interrupted pc: the frame-record walk crosses it as any other).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from qmpprof.arch.aarch64code import PROLOGUES, is_hint, signed
from qmpprof.arch.base import FrameRecordsOnly, PrologueRule

_MASK = (1 << 64) - 1
_UPPER_HALF = 0xFF80_0000_0000_0000  # bits 63..55 set: the TTBR1 half for any T1SZ
_BIT55 = 1 << 55
# The lower half's plain-form bound when TCR_EL1 is unknown: 48-bit addresses, the smallest
# user virtual-address size of Linux on arm64 (4K pages, 4 levels; Debian's 6.1 and 6.12).
_PLAIN_LOW = 1 << 48


def tnsz(tcr_el1: int) -> tuple[int, int]:
    """(T0SZ, T1SZ) of a TCR_EL1 value: bits 5..0 and 21..16 (Arm ARM, D19.2.139)."""
    return tcr_el1 & 0x3F, (tcr_el1 >> 16) & 0x3F


@dataclass(frozen=True, slots=True)
class AArch64(FrameRecordsOnly):
    """The aarch64 instruction set; ``t0sz``/``t1sz`` are the guest's translation settings
    (``translated``), None while they are not known."""

    t0sz: int | None = None
    t1sz: int | None = None
    name: str = "aarch64"
    address_size: int = 8
    pc: int = 32
    sp: int = 31
    fp: int = 29
    names: tuple[str, ...] = (*(f"x{n}" for n in range(31)), "sp", "pc")
    elf_machine: tuple[int, int] = (183, 64)  # EM_AARCH64, ELFCLASS64
    kernel_boundary: int = _UPPER_HALF
    shared_from: int = _UPPER_HALF
    space_register: str = "ttbr0"
    mask: int = _MASK
    same_level_trap_saves_sp: bool = True  # an exception leaves SP_EL1 where it was
    frame_record: tuple[int, int, int] = (0, 8, 16)  # [x29], [x29 + 8]

    @property
    def translation_registers(self) -> tuple[str, ...]:
        # TTBR1_EL1: the kernel's tables, walked where no vCPU runs the kernel to translate.
        return ("TCR_EL1", "TTBR1_EL1")

    @property
    def user_space_end(self) -> int | None:
        # TTBR0's half: 64 - T0SZ bits (48 with 4 levels of 4 KiB pages, as without TCR_EL1).
        return _PLAIN_LOW if self.t0sz is None else 1 << (64 - self.t0sz)

    def translated(self, values: Mapping[str, int]) -> AArch64:
        """Under TCR_EL1's sizes (as QEMU's gdbstub reports it) return addresses are stripped
        of pointer-authentication codes; without it, this one."""
        tcr_el1 = values.get("TCR_EL1")
        if tcr_el1 is None:
            return self
        t0sz, t1sz = tnsz(tcr_el1)
        return dataclasses.replace(self, t0sz=t0sz, t1sz=t1sz)

    def return_address(self, value: int) -> int | None:
        if value > _MASK or value < 0:
            return None
        upper = bool(value & _BIT55)
        size = self.t1sz if upper else self.t0sz
        if size is None:
            plain = value >= _UPPER_HALF if upper else value < _PLAIN_LOW
            return value if plain else None
        code_bits = (1 << (64 - size)) - 1
        return value | (_MASK ^ code_bits) if upper else value & code_bits

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
        # BL and BLR: the two ways to call, each one 4-byte instruction.
        if len(code) < 4:
            return False
        insn = int.from_bytes(code[-4:], "little")
        return insn >> 26 == 0b100101 or insn & 0xFFFF_FC1F == 0xD63F_0000

    def same_code(self, file: bytes, running: bytes) -> bool:
        return file == running

    def call_before(self, code: bytes, ra: int) -> int | None:
        # BL: 0b100101 and a signed 26-bit word offset from the instruction itself.
        if len(code) < 4:
            return None
        insn = int.from_bytes(code[-4:], "little")
        if insn >> 26 != 0b100101:
            return None
        return (ra - 4 + signed(insn & 0x3FF_FFFF, 26) * 4) & _MASK

    def branches(self, code: bytes, addr: int) -> list[tuple[int, int | None]]:
        out: list[tuple[int, int | None]] = []
        for off in range(0, len(code) - 3, 4):
            insn = int.from_bytes(code[off : off + 4], "little")
            here = addr + off
            target = _branch_target(insn, here)
            if target is not None:
                out.append((here + 4, None if target < 0 else target & _MASK))
        return out

    def lone_jump(self, code: bytes, addr: int) -> tuple[int, int] | None:
        for at in range(0, len(code) - 3, 4):
            insn = int.from_bytes(code[at : at + 4], "little")
            if not is_hint(insn):
                if insn >> 26 != 0b000101:  # B imm26
                    return None
                return addr + at + 4, (addr + at + signed(insn & 0x3FF_FFFF, 26) * 4) & _MASK
        return None


def _branch_target(insn: int, here: int) -> int | None:
    """The target of a jump (B, B.cond, CBZ/CBNZ, TBZ/TBNZ, BR) at ``here``; -1 for BR (through
    a register); None when ``insn`` is no jump (BL and BLR are calls, RET a return)."""
    if insn >> 26 == 0b000101:  # B imm26
        return here + signed(insn & 0x3FF_FFFF, 26) * 4
    if insn >> 24 == 0b0101_0100 and not insn & 0x10:  # B.cond imm19
        return here + signed((insn >> 5) & 0x7_FFFF, 19) * 4
    if (insn >> 25) & 0x3F == 0b011010:  # CBZ/CBNZ imm19
        return here + signed((insn >> 5) & 0x7_FFFF, 19) * 4
    if (insn >> 25) & 0x3F == 0b011011:  # TBZ/TBNZ imm14
        return here + signed((insn >> 5) & 0x3FFF, 14) * 4
    if insn & 0xFFFF_FC1F == 0xD61F_0000:  # BR Xn
        return -1
    return None


AARCH64 = AArch64()
