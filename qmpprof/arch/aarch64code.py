"""aarch64 machine code read by hand: prologue and epilogue analysis of the frame the CPU was
interrupted in, where the frame-record walk (x29, x30) is wrong.

A function compiled with frame pointers saves its frame record (x29, x30) in its prologue and
points x29 at it; until then, and again once its epilogue has loaded the record back, the return
address is still in x30 (the link register) and x29 is the caller's: walking [x29 + 8] there
skips the caller. A leaf function (Linux builds arm64 without leaf frame records) never saves
one. The few instructions that matter are decoded by their encodings (Arm ARM, C4.1), no
disassembler needed:

- the prologue, followed from the function's start (kallsyms) to the pc: ``stp x29, x30,
  [sp, #-N]!``, or ``sub sp, sp, #N`` then ``stp x29, x30, [sp, #M]``, then ``mov x29, sp`` /
  ``add x29, sp, #M``; hints (``paciasp``, ``bti``, ftrace's patchable ``nop``s) change nothing;
- the epilogue, followed forward from the pc to its ``ret`` (``autiasp``, ``retaa`` too) along
  straight code: a ``ldp x29, x30`` on the way means the record is still live at the pc; none
  means it was loaded back (or never saved), and the ``add sp, sp, #K`` (or post-indexed loads
  from sp) still ahead say where the caller's stack pointer is.

A branch, a call or any other write to sp on the way forward leaves the epilogue unknown, and the
prologue's state decides.

Code no function symbol covers may be a veneer: what a linker (or Linux's module loader, for a
call out of a module's reach, in the module's PLT) puts between a call and its target. The
procedure call standard (AAPCS64, 6.4) lets a veneer change only the intra-procedure-call
registers x16 and x17: code that from the pc writes only those (ADRP, ADD, LDR, MOVZ/MOVN/MOVK)
and jumps through one of them (``br x16``) made no frame, and its caller is in x30. Answers are
cached per (code, pc).
"""

from __future__ import annotations

from qmpprof.arch.base import PrologueRule
from qmpprof.arch.prologuecache import CachedAnalysis

FP, LR, SP = 29, 30, 31
_MAX_SCAN = 4096  # bytes from the function's start: a longer one is left to frame records
_MAX_EPILOGUE = 32  # instructions followed forward to a return
_MASK64 = (1 << 64) - 1
_RESTORES = object()  # the epilogue ahead loads the record back: it is live at the pc


def _imm7(insn: int) -> int:
    value = (insn >> 15) & 0x7F
    return (value - 0x80 if value & 0x40 else value) * 8


def _imm9(insn: int) -> int:
    value = (insn >> 12) & 0x1FF
    return value - 0x200 if value & 0x100 else value


def signed(value: int, bits: int) -> int:
    """``value``'s low ``bits`` bits read as a two's-complement number."""
    return value - (1 << bits) if value >> (bits - 1) else value


def add_imm(insn: int) -> int:
    """The immediate of ADD/SUB (immediate), shifted by 12 when ``sh`` is set."""
    return ((insn >> 10) & 0xFFF) << (12 if insn & (1 << 22) else 0)


def is_adrp(insn: int) -> bool:
    return insn & 0x9F00_0000 == 0x9000_0000


def adrp_page(insn: int, at: int) -> int:
    """The address ADRP at ``at`` puts in its register: its 4 KiB page plus a signed 33-bit
    offset (immlo, bits 29-30; immhi, bits 5-23)."""
    page = ((insn >> 29) & 3 | ((insn >> 5) & 0x7_FFFF) << 2) << 12
    return ((at & ~0xFFF) + signed(page, 33)) & _MASK64


def branch_target(insn: int, at: int) -> int | None:
    """Where B (not BL) at ``at`` goes: ``at`` plus a signed 26-bit count of words (imm26);
    None for any other instruction."""
    if insn >> 26 != 0b000101:
        return None
    return (at + signed(insn & 0x3FF_FFFF, 26) * 4) & _MASK64


def is_eret(insn: int) -> bool:
    """ERET, ERETAA, ERETAB: the return from an exception."""
    return insn in (0xD69F_03E0, 0xD69F_0BFF, 0xD69F_0FFF)


def is_jump(insn: int) -> bool:
    """B, BR, RET, ERET (and their authenticated forms), BRK: what follows is not reached
    from it."""
    return (
        insn >> 26 == 0b000101  # B
        or (insn >> 25 == 0b110_1011 and (insn >> 21) & 0xF in (0b0000, 0b0010, 0b0100, 0b1000))
        or insn & 0xFFE0_001F == 0xD420_0000  # BRK
    )


def sets_fp(insn: int) -> int | None:
    """The offset of ``add x29, sp, #offset`` (a frame record's address made in x29); None for
    any other instruction."""
    return add_imm(insn) if _is_add(insn, FP, SP) else None


def pair_stored_at(insn: int, offset: int) -> tuple[int, int] | None:
    """(Rt, Rt2) of ``stp xt, xt2, [sp, #offset]`` (31: xzr); None for any other instruction."""
    if _pair(insn) != ("stp", offset):
        return None
    return insn & 0x1F, (insn >> 10) & 0x1F


def stored_at(insn: int, offset: int) -> int | None:
    """Rt of ``str xt, [sp, #offset]`` (unsigned offset; 31: xzr); None for any other
    instruction."""
    if insn & 0xFFC0_03E0 != 0xF900_0000 | SP << 5 or ((insn >> 10) & 0xFFF) * 8 != offset:
        return None
    return insn & 0x1F


def moved_imm(insn: int) -> tuple[int, int] | None:
    """(Rd, value) of ``mov xd, #value`` as MOVZ (64-bit); None for any other instruction."""
    if insn & 0xFF80_0000 != 0xD280_0000:
        return None
    return insn & 0x1F, ((insn >> 5) & 0xFFFF) << ((insn >> 21) & 3) * 16


def _is_add(insn: int, rd: int, rn: int) -> bool:
    """ADD (immediate), 64-bit, ``rd`` from ``rn`` (``mov x29, sp`` is ``add x29, sp, #0``)."""
    return insn & 0xFF80_0000 == 0x9100_0000 and insn & 0x3FF == rn << 5 | rd


def _fields(insn: int) -> tuple[int, int]:
    """(Rd or Rt, Rn) of an instruction."""
    return insn & 0x1F, (insn >> 5) & 0x1F


def is_hint(insn: int) -> bool:
    """NOP, PACIASP, AUTIASP, BTI and the other hints: nothing the walk needs changes."""
    return insn & 0xFFFF_F01F == 0xD503_201F


def is_return(insn: int) -> bool:
    """RET Xn, RETAA, RETAB."""
    return insn & 0xFFFF_FC1F == 0xD65F_0000 or insn in (0xD65F_0BFF, 0xD65F_0FFF)


def _is_branch(insn: int) -> bool:
    """Any other change of flow: B, BL, B.cond, CBZ/CBNZ, TBZ/TBNZ, BR, BLR, ERET and kin."""
    return (
        insn >> 26 & 0x1F == 0b00101  # B, BL
        or insn >> 25 & 0x3F in (0b011010, 0b011011)  # CBZ/CBNZ, TBZ/TBNZ
        or insn >> 24 == 0b0101_0100  # B.cond
        or insn >> 25 == 0b110_1011  # BR, BLR, RET, ERET, and their authenticated forms
    )


def _pair(insn: int) -> tuple[str, int] | None:
    """A 64-bit STP/LDP with sp as base: (kind, imm) where kind is 'stp', 'stp!' (pre-index),
    'stp+' (post-index), 'ldp', 'ldp!', 'ldp+'; None for any other instruction."""
    top = insn & 0xFFC0_0000
    kind = {
        0xA900_0000: "stp", 0xA980_0000: "stp!", 0xA880_0000: "stp+",
        0xA940_0000: "ldp", 0xA9C0_0000: "ldp!", 0xA8C0_0000: "ldp+",
    }.get(top)  # fmt: skip
    if kind is None or (insn >> 5) & 0x1F != SP:
        return None
    return kind, _imm7(insn)


def _is_record(insn: int) -> bool:
    return insn & 0x1F == FP and (insn >> 10) & 0x1F == LR


def _sp_writeback(insn: int) -> int | None:
    """How much a load or store with writeback to sp moves it (LDR/STR of a register, pre- or
    post-indexed); None for any other instruction."""
    if insn & 0x3F20_0400 == 0x3800_0400 and (insn >> 5) & 0x1F == SP:
        return _imm9(insn)
    return None


def _analyze(
    code: bytes, code_addr: int, pc: int, func_start: int | None, _end: int | None
) -> PrologueRule | None:
    off = pc - code_addr
    if off < 0 or off + 4 > len(code) or off & 3:
        return None
    ahead = _epilogue(code, off)
    if isinstance(ahead, int):
        # The record was loaded back (or never saved): x29 is the caller's, x30 the return.
        return PrologueRule(ahead, ra_register=LR)
    if func_start is None:
        return PrologueRule(0, ra_register=LR) if _veneer(code, off) else None
    if not 0 <= pc - func_start <= _MAX_SCAN or func_start < code_addr:
        return None
    return _prologue(code, func_start - code_addr, off)


_IP0, _IP1 = 16, 17
_VENEER_WORDS = 6  # the longest: four moves, a BTI, the jump


def _veneer(code: bytes, off: int) -> bool:
    """Whether the code from ``off`` writes only x16/x17 and then jumps through one of them."""
    end = min(len(code), off + 4 * _VENEER_WORDS)
    for at in range(off, end - 3, 4):
        insn = int.from_bytes(code[at : at + 4], "little")
        rd, rn = _fields(insn)
        if insn & 0xFFFF_FC1F == 0xD61F_0000:  # BR Xn
            return rn in (_IP0, _IP1)
        if is_hint(insn) or (
            rd in (_IP0, _IP1)
            and (
                is_adrp(insn)
                or insn & 0xFF00_0000 == 0x5800_0000  # LDR Xt, literal
                or insn & 0x9F80_0000 == 0x9280_0000  # MOVN, MOVZ, MOVK (64-bit)
                or (
                    rn in (_IP0, _IP1)
                    and (
                        insn & 0xFF80_0000 == 0x9100_0000  # ADD Xd, Xn, #imm
                        or insn & 0xFFC0_0000 == 0xF940_0000  # LDR Xt, [Xn, #imm]
                    )
                )
            )
        ):
            continue
        return False
    return False


def _epilogue(code: bytes, off: int) -> int | object | None:
    """Forward from ``off`` to a return along straight code: the bytes sp still moves up on the
    way when the record is not loaded back on it, ``_RESTORES`` when it is, None: unknown."""
    moved = 0
    end = min(len(code), off + 4 * _MAX_EPILOGUE)
    for at in range(off, end - 3, 4):
        insn = int.from_bytes(code[at : at + 4], "little")
        if is_return(insn):
            return moved
        pair = _pair(insn)
        if pair is not None:
            kind, imm = pair
            if kind.startswith("ldp") and _is_record(insn):
                return _RESTORES
            if kind == "ldp+":
                moved += imm
            elif kind != "ldp":
                return None  # a store, or sp moved down: not an epilogue
            continue
        rd, rn = _fields(insn)
        if insn & 0xFF80_0000 == 0x9100_0000 and rd == SP:  # ADD (immediate) to sp
            if rn != SP:
                return None  # sp from another register (mov sp, x29): unknown
            moved += add_imm(insn)
        elif insn & 0xFF80_0000 == 0xD100_0000 and rd == SP:  # SUB (immediate) to sp
            return None
        elif (writeback := _sp_writeback(insn)) is not None:
            if insn & 0x0040_0000 == 0:  # a store
                return None
            moved += writeback
        elif _is_branch(insn):
            return None
    return None


def _prologue(code: bytes, start: int, off: int) -> PrologueRule | None:
    """The state at ``off`` after the prologue instructions from ``start``: the frame's size
    below the caller's sp, where the record was stored (from sp), whether x29 points at it."""
    frame = 0
    record: int | None = None
    for at in range(start, off, 4):
        insn = int.from_bytes(code[at : at + 4], "little")
        pair = _pair(insn)
        if pair is not None:
            kind, imm = pair
            if kind == "stp!" and _is_record(insn):
                frame, record = frame - imm, 0
            elif kind == "stp" and _is_record(insn):
                record = imm
            elif kind == "stp!":
                frame -= imm
                record = None if record is None else record - imm
            continue
        rd, rn = _fields(insn)
        if insn & 0xFF80_0000 == 0xD100_0000 and rd == SP and rn == SP:  # sub sp, sp, #N
            imm = add_imm(insn)
            frame += imm
            record = None if record is None else record + imm
        elif _is_add(insn, FP, SP) and record == add_imm(insn):  # add x29, sp, #M
            return None  # x29 points at the record: frame records are right from here
    if record is None:
        return PrologueRule(frame, ra_register=LR)
    return PrologueRule(frame, fp_offset=record - frame, ra_offset=record + 8 - frame)


PROLOGUES = CachedAnalysis(_analyze)
