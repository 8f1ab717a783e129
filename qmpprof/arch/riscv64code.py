"""riscv64 machine code read by hand: the few instructions the walk needs, in their 32-bit and
compressed (RVC, 16-bit) encodings (the RISC-V unprivileged ISA, chapters 2 and 16), and the
prologue and epilogue analysis of the frame the CPU was interrupted in.

A function compiled with frame pointers (GCC, Linux's CONFIG_FRAME_POINTER) opens with
``addi sp, sp, -N``, ``sd ra, N-8(sp)``, ``sd s0, N-16(sp)``, ``addi s0, sp, N`` (compressed:
``c.addi``/``c.addi16sp``, ``c.sdsp``, ``c.addi4spn``), so that s0 is the caller's sp and the
frame record (the caller's s0, then ra) sits just below it; Debian's 6.12 saves ra in leaves too
(``memchr``: ``c.addi sp,-16; c.sdsp s0,0; c.sdsp ra,8; c.addi4spn s0,sp,16``). Until ``sd ra``
the return address is still in ra, and until ``addi s0`` s0 is the caller's: walking the record
from s0 there skips the caller; the same holds once the epilogue (``ld ra``, ``ld s0``,
``addi sp``) has run. Assembly leaves (``strlen``) never save anything: ra all along.

- the epilogue, followed forward from the pc to its ``ret`` along straight code, says exactly
  where ra and s0 are and how far sp still moves up;
- when a branch or a call comes first, the prologue, followed from the function's start to the
  pc, says how far sp moved down and where ra and s0 were stored;
- when a branch comes first there too, a function none of whose instructions (its symbol's
  extent) writes sp, ra or s0 is a leaf: ra, whichever way the pc was reached.

Answers are cached per (code, pc, function start).
"""

from __future__ import annotations

from collections.abc import Iterator

from qmpprof.arch.base import PrologueRule
from qmpprof.arch.prologuecache import CachedAnalysis

RA, SP, FP = 1, 2, 8  # x1, x2, x8 (s0)
_MAX_SCAN = 4096  # bytes from the function's start: a longer prologue is left to frame records
_MAX_EPILOGUE = 32  # instructions followed forward to a return
_MAX_LEAF = 4096  # bytes of a function read whole for a write to sp, ra or s0
_MASK64 = (1 << 64) - 1
# Opcodes (bits 6..0) of the 32-bit instructions that write their integer rd.
_WRITES_RD = frozenset({0x37, 0x17, 0x6F, 0x67, 0x03, 0x13, 0x33, 0x1B, 0x3B, 0x2F, 0x73})


def signed(value: int, bits: int) -> int:
    """``value``'s low ``bits`` bits read as a two's-complement number."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _bits(insn: int, hi: int, lo: int) -> int:
    return (insn >> lo) & ((1 << (hi - lo + 1)) - 1)


def length(code: bytes, at: int) -> int:
    """Bytes of the instruction at ``at``: 2 when its low bits are not 0b11 (RVC), else 4."""
    return 2 if code[at] & 3 != 3 else 4


def word(code: bytes, at: int) -> int | None:
    """The instruction at ``at``, its encoding as a number; None past the end of ``code``."""
    size = 2 if at < len(code) and code[at] & 3 != 3 else 4
    if at < 0 or at + size > len(code):
        return None
    return int.from_bytes(code[at : at + size], "little")


def decode(insn: int) -> tuple[str, int, int, int]:
    """What the walk needs of one instruction: (kind, rd, rs1, imm). Kinds: ``addi`` (rd = rs1 +
    imm), ``sd`` (rs1 = the base, rd = the stored register, imm = the offset), ``ld``, ``jal``
    (rd = the link register; imm: the offset), ``jalr`` (rd = link, rs1 = target register,
    imm: offset), ``branch`` (imm: the offset), ``write`` (some other write to rd), ``other``."""
    if insn & 3 != 3:
        return _decode16(insn)
    opcode, rd, rs1 = insn & 0x7F, _bits(insn, 11, 7), _bits(insn, 19, 15)
    funct3, i_imm = _bits(insn, 14, 12), signed(insn >> 20, 12)
    if opcode == 0x13 and funct3 == 0:
        return "addi", rd, rs1, i_imm
    if opcode == 0x23 and funct3 == 3:
        return "sd", _bits(insn, 24, 20), rs1, signed(_bits(insn, 31, 25) << 5 | rd, 12)
    if opcode == 0x03 and funct3 == 3:
        return "ld", rd, rs1, i_imm
    if opcode == 0x6F:
        imm = (_bits(insn, 31, 31) << 20 | _bits(insn, 19, 12) << 12
               | _bits(insn, 20, 20) << 11 | _bits(insn, 30, 21) << 1)  # fmt: skip
        return "jal", rd, 0, signed(imm, 21)
    if opcode == 0x67:
        return "jalr", rd, rs1, i_imm
    if opcode == 0x63:
        imm = (_bits(insn, 31, 31) << 12 | _bits(insn, 7, 7) << 11
               | _bits(insn, 30, 25) << 5 | _bits(insn, 11, 8) << 1)  # fmt: skip
        return "branch", 0, rs1, signed(imm, 13)
    if opcode in _WRITES_RD:
        return "write", rd, rs1, 0
    return "other", 0, 0, 0


def _decode16(insn: int) -> tuple[str, int, int, int]:
    quadrant, funct3 = insn & 3, insn >> 13
    rd, rs2 = _bits(insn, 11, 7), _bits(insn, 6, 2)
    rd_short = 8 + _bits(insn, 4, 2)  # rd' of quadrant 0
    if quadrant == 0:
        if funct3 == 0:  # c.addi4spn rd', sp, nzuimm[5:4|9:6|2|3]
            imm = (_bits(insn, 12, 11) << 4 | _bits(insn, 10, 7) << 6
                   | _bits(insn, 6, 6) << 2 | _bits(insn, 5, 5) << 3)  # fmt: skip
            return "addi", rd_short, SP, imm
        return ("write", rd_short, 0, 0) if funct3 in (2, 3) else ("other", 0, 0, 0)
    if quadrant == 1:
        imm6 = signed(_bits(insn, 12, 12) << 5 | rs2, 6)
        if funct3 == 0:  # c.addi rd, imm (c.nop with rd 0)
            return "addi", rd, rd, imm6
        if funct3 == 3 and rd == SP:  # c.addi16sp nzimm[9|4|6|8:7|5]
            imm = (_bits(insn, 12, 12) << 9 | _bits(insn, 6, 6) << 4 | _bits(insn, 5, 5) << 6
                   | _bits(insn, 4, 3) << 7 | _bits(insn, 2, 2) << 5)  # fmt: skip
            return "addi", SP, SP, signed(imm, 10)
        if funct3 in (1, 2, 3):  # c.addiw, c.li, c.lui
            return "write", rd, 0, 0
        if funct3 == 4:  # the ALU ops on rd'
            return "write", 8 + _bits(insn, 9, 7), 0, 0
        if funct3 == 5:  # c.j offset[11|4|9:8|10|6|7|3:1|5]
            imm = (_bits(insn, 12, 12) << 11 | _bits(insn, 11, 11) << 4 | _bits(insn, 10, 9) << 8
                   | _bits(insn, 8, 8) << 10 | _bits(insn, 7, 7) << 6 | _bits(insn, 6, 6) << 7
                   | _bits(insn, 5, 3) << 1 | _bits(insn, 2, 2) << 5)  # fmt: skip
            return "jal", 0, 0, signed(imm, 12)
        # c.beqz, c.bnez offset[8|4:3] (bits 12|11:10), [7:6|2:1|5] (bits 6:5|4:3|2)
        imm = (_bits(insn, 12, 12) << 8 | _bits(insn, 11, 10) << 3 | _bits(insn, 6, 5) << 6
               | _bits(insn, 4, 3) << 1 | _bits(insn, 2, 2) << 5)  # fmt: skip
        return "branch", 0, 8 + _bits(insn, 9, 7), signed(imm, 9)
    if quadrant == 2:
        if funct3 == 3:  # c.ldsp rd, uimm[5|4:3|8:6](sp)
            imm = _bits(insn, 12, 12) << 5 | _bits(insn, 6, 5) << 3 | _bits(insn, 4, 2) << 6
            return "ld", rd, SP, imm
        if funct3 == 7:  # c.sdsp rs2, uimm[5:3|8:6](sp)
            return "sd", rs2, SP, _bits(insn, 12, 10) << 3 | _bits(insn, 9, 7) << 6
        if funct3 == 4:
            big = _bits(insn, 12, 12)
            if rs2 == 0 and rd != 0:  # c.jr rs1 / c.jalr rs1
                return "jalr", RA if big else 0, rd, 0
            return ("write", rd, 0, 0) if rs2 else ("other", 0, 0, 0)  # c.mv, c.add
        if funct3 in (0, 2):  # c.slli, c.lwsp
            return "write", rd, 0, 0
    return "other", 0, 0, 0


def is_return(kind: str, rd: int, rs1: int, imm: int) -> bool:
    """``ret`` (``jalr x0, 0(ra)``, ``c.jr ra``)."""
    return kind == "jalr" and rd == 0 and rs1 == RA and imm == 0


def is_call(kind: str, rd: int) -> bool:
    """``jal``/``jalr`` linking in ra (or t0, the alternate link register)."""
    return kind in ("jal", "jalr") and rd in (RA, 5)


def _analyze(
    code: bytes, code_addr: int, pc: int, func_start: int | None, func_end: int | None
) -> PrologueRule | None:
    off = pc - code_addr
    if off < 0 or off + 2 > len(code) or off & 1:
        return None
    ahead = _epilogue(code, off)
    if ahead is not None:
        return ahead
    if func_start is None or not 0 <= pc - func_start <= _MAX_SCAN or func_start < code_addr:
        return None
    found = _prologue(code, func_start - code_addr, off)
    if found is None and func_end is not None and _leaf(code, func_start, func_end, code_addr):
        return PrologueRule(0, ra_register=RA)
    return found


def _leaf(code: bytes, start: int, end: int, code_addr: int) -> bool:
    """Whether no instruction of the function at ``start``..``end`` writes sp, ra or s0 (nor
    calls): an assembly leaf, whose every path leaves the caller's sp and ra as they came,
    however it branches (``memset``'s computed jump into its run of stores)."""
    if end - start > _MAX_LEAF or end - code_addr > len(code):
        return False
    return not any(
        kind not in ("sd", "branch") and rd in (SP, RA, FP)
        for _, _, (kind, rd, _, _) in instructions(code, code_addr, start, end)
    )


def instructions(
    code: bytes, code_addr: int, start: int, end: int
) -> Iterator[tuple[int, int, tuple[str, int, int, int]]]:
    """Each instruction in [start, end) of ``code`` (at ``code_addr``): its address, size and
    ``decode``'s reading; it ends early where the code does."""
    at = start
    while at < end:
        insn = word(code, at - code_addr)
        if insn is None:
            return
        size = length(code, at - code_addr)
        yield at, size, decode(insn)
        at += size


def _epilogue(code: bytes, off: int) -> PrologueRule | None:
    """Forward from ``off`` to a ``ret`` along straight code: the rule the loads and the sp
    moves on the way give, None when something else comes first."""
    moved = 0
    ra_at: int | None = None  # sp-relative at ``off``
    fp_at: int | None = None
    at = off
    for _ in range(_MAX_EPILOGUE):
        insn = word(code, at)
        if insn is None:
            return None
        kind, rd, rs1, imm = decode(insn)
        if is_return(kind, rd, rs1, imm):
            if ra_at is None:
                return PrologueRule(moved, fp_offset=_from_cfa(fp_at, moved), ra_register=RA)
            return PrologueRule(moved, fp_offset=_from_cfa(fp_at, moved), ra_offset=ra_at - moved)
        if kind in ("jal", "jalr", "branch"):
            return None
        if kind == "ld" and rs1 == SP and rd in (RA, FP):
            if rd == RA:
                ra_at = moved + imm
            else:
                fp_at = moved + imm
        elif kind == "addi" and rd == SP and rs1 == SP and imm > 0:
            moved += imm
        elif kind == "sd" and rs1 == SP:
            return None  # a store to the frame: not an epilogue
        elif rd in (SP, RA, FP) and kind != "sd":
            return None  # sp, ra or s0 from elsewhere: unknown
        at += length(code, at)
    return None


def _from_cfa(at: int | None, moved: int) -> int | None:
    return None if at is None else at - moved


def _prologue(code: bytes, start: int, off: int) -> PrologueRule | None:
    """The state at ``off`` after the prologue instructions from ``start``: the frame's size
    below the caller's sp, where ra and s0 were stored (from the caller's sp)."""
    frame = 0
    ra_at: int | None = None  # from the caller's sp (the CFA)
    fp_at: int | None = None
    at = start
    while at < off:
        insn = word(code, at)
        if insn is None:
            return None
        kind, rd, rs1, imm = decode(insn)
        if kind == "addi" and rd == SP:
            if rs1 != SP:
                return None
            frame -= imm
        elif kind == "sd" and rs1 == SP and rd in (RA, FP):
            if rd == RA:
                ra_at = imm - frame
            else:
                fp_at = imm - frame
        elif kind == "addi" and rd == FP and rs1 == SP and imm == frame and ra_at is not None:
            return None  # s0 is the caller's sp, ra saved: frame records are right from here
        elif kind in ("jal", "jalr", "branch") or (rd in (SP, RA) and kind != "sd"):
            return None  # the prologue is not straight code up to the pc: unknown
        # Any other write to s0 makes it a register like others (code built without frame
        # pointers: ``mv s0, a0`` in liblzma's lzma_code): where it was saved still holds.
        at += length(code, at)
    if ra_at is None:
        return PrologueRule(frame, fp_offset=fp_at, ra_register=RA)
    return PrologueRule(frame, fp_offset=fp_at, ra_offset=ra_at)


PROLOGUES = CachedAnalysis(_analyze)
