"""The call-frame instruction (DW_CFA_*) interpreter: CIE + FDE programs -> compiled rows.

DWARF 5 section 6.4 describes a table with one row per code location; each row gives the rule
for the CFA and for every register. This module runs a CIE's initial instructions and an FDE's
instructions once and compiles the rows into ``Rule`` values the unwinder applies with a few
dictionary lookups. It deliberately does not use pyelftools (0.33 rejects DW_CFA_GNU_args_size).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from qmpprof.dwarf.encoding import CfiDecodeError, Reader


class Kind(enum.IntEnum):
    """How a register of the caller is recovered."""

    UNDEFINED = 0  # not recoverable (for the return address column: the outermost frame)
    SAME = 1  # unchanged by this frame
    OFFSET = 2  # saved at CFA + value
    VAL_OFFSET = 3  # the value is CFA + value
    REGISTER = 4  # in register number ``value``
    EXPRESSION = 5  # saved at the address the expression computes (CFA pushed first)
    VAL_EXPRESSION = 6  # the value is what the expression computes (CFA pushed first)


@dataclass(frozen=True, slots=True)
class RegRule:
    kind: Kind
    value: int = 0
    expr: bytes = b""


@dataclass(frozen=True, slots=True)
class Rule:
    """One compiled row of the CFI table, valid for link addresses ``start <= pc < end``.

    The CFA is ``reg[cfa_reg] + cfa_offset``, or the result of ``cfa_expr`` when that is set.
    ``regs`` holds the explicit rules, sorted by DWARF register number; a register without one
    keeps its value (x86 compilers only describe callee-saved registers they touch).
    """

    start: int
    end: int
    cfa_reg: int
    cfa_offset: int
    cfa_expr: bytes | None
    regs: tuple[tuple[int, RegRule], ...]
    ra: int  # the return-address column (16 = RIP on x86_64, 8 = EIP on i386)
    signal: bool  # CIE augmentation "S": a signal/trap frame, its caller's pc is exact
    # The common case precompiled for the unwinder's fast path: when every explicit rule is
    # "saved at CFA+n" and the return address is one of them, the (register, n) pairs.
    saved_at: tuple[tuple[int, int], ...] | None = None

    def reg(self, number: int) -> RegRule | None:
        for reg, rule in self.regs:
            if reg == number:
                return rule
        return None


@dataclass(frozen=True, slots=True)
class Cie:
    """What an FDE needs from its CIE; the initial instructions are data[init_start:init_end]."""

    code_align: int
    data_align: int
    ra: int
    fde_enc: int
    augmented: bool  # "z": FDEs carry an augmentation data block
    signal: bool
    init_start: int
    init_end: int
    address_size: int = 8  # of absolute pointers (DW_CFA_set_loc): 4 on i386


@dataclass(slots=True)
class _State:
    cfa_reg: int = 7
    cfa_offset: int = 0
    cfa_expr: bytes | None = None
    regs: dict[int, RegRule] | None = None

    def copy(self) -> _State:
        return _State(self.cfa_reg, self.cfa_offset, self.cfa_expr, dict(self.regs or {}))


class _Reached(Exception):
    """The row ``_Run.until`` asked for is built: the program need not run further."""


def compile_rows(
    data: bytes,
    base_addr: int,
    cie: Cie,
    fde_range: tuple[int, int],
    pc_range: tuple[int, int],
    until: int | None = None,
) -> list[Rule]:
    """Rows of one FDE whose instructions are ``data[fde_range[0]:fde_range[1]]``; with
    ``until``, only the row covering that address (none if no row does), the program run no
    further than that row: an FDE's first lookup in a pause builds one row, not all of them.

    Malformed or unknown instructions end the table early: the rows decoded so far stay valid,
    addresses after the failure get no row (the unwinder then falls back).
    """
    out: list[Rule] = []
    run = _Run(data, base_addr, cie, pc_range[0], out, until)
    try:
        run.execute(cie.init_start, cie.init_end)
        run.initial = run.state.copy()
        run.execute(*fde_range)
        if pc_range[1] > run.loc:
            run.advance(pc_range[1])
    except (CfiDecodeError, _Reached):
        pass
    return out


class _Run:
    __slots__ = ("base_addr", "cie", "data", "initial", "loc", "out", "saved", "state", "until")

    def __init__(
        self,
        data: bytes,
        base_addr: int,
        cie: Cie,
        loc: int,
        out: list[Rule],
        until: int | None = None,
    ) -> None:
        self.data = data
        self.base_addr = base_addr
        self.cie = cie
        self.loc = loc
        self.out = out
        self.until = until  # build only the row covering this address (None: every row)
        self.state = _State(regs={})
        self.initial: _State | None = None  # None while running the CIE's initial instructions
        self.saved: list[_State] = []

    def advance(self, new_loc: int) -> None:
        if self.initial is None:  # location changes are meaningless in a CIE
            return
        if new_loc < self.loc:
            raise CfiDecodeError("location moves backwards")
        until = self.until
        if until is not None and new_loc <= until:
            self.loc = new_loc  # a row before the one asked for: not built
            return
        if new_loc > self.loc:
            s = self.state
            regs = tuple(sorted((s.regs or {}).items()))
            saved_at = tuple((reg, rule.value) for reg, rule in regs)
            plain = all(rule.kind is Kind.OFFSET for _, rule in regs) and any(
                reg == self.cie.ra for reg, _ in regs
            )
            self.out.append(
                Rule(
                    self.loc, new_loc, s.cfa_reg, s.cfa_offset, s.cfa_expr,
                    regs, self.cie.ra, self.cie.signal, saved_at if plain else None,
                )
            )  # fmt: skip
            self.loc = new_loc
            if until is not None:
                raise _Reached

    def set_reg(self, reg: int, rule: RegRule) -> None:
        assert self.state.regs is not None
        self.state.regs[reg] = rule

    def restore(self, reg: int) -> None:
        assert self.state.regs is not None
        initial = self.initial.regs if self.initial is not None else None
        if initial is not None and reg in initial:
            self.state.regs[reg] = initial[reg]
        else:
            self.state.regs.pop(reg, None)

    def execute(self, start: int, end: int) -> None:
        # No slicing: copying a multi-megabyte section per FDE would cost more than the rows.
        r = Reader(self.data, start, self.base_addr, self.cie.address_size)
        while r.pos < end:
            op = r.u8()
            high = op & 0xC0
            if high == 0x40:  # advance_loc: delta in the low 6 bits
                self.advance(self.loc + (op & 0x3F) * self.cie.code_align)
            elif high == 0x80:  # offset: register in the low 6 bits, factored offset
                self.set_reg(op & 0x3F, RegRule(Kind.OFFSET, r.uleb() * self.cie.data_align))
            elif high == 0xC0:  # restore: register in the low 6 bits
                self.restore(op & 0x3F)
            elif not self._location_op(op, r) and not self._cfa_op(op, r):
                self._register_op(op, r)

    def _location_op(self, op: int, r: Reader) -> bool:
        code_align = self.cie.code_align
        if op == 0x00:  # nop
            pass
        elif op == 0x01:  # set_loc
            self.advance(r.pointer(self.cie.fde_enc))
        elif op == 0x02:  # advance_loc1
            self.advance(self.loc + r.u8() * code_align)
        elif op == 0x03:  # advance_loc2
            self.advance(self.loc + r.u16() * code_align)
        elif op == 0x04:  # advance_loc4
            self.advance(self.loc + r.u32() * code_align)
        elif op == 0x1D:  # MIPS_advance_loc8
            self.advance(self.loc + r.u64() * code_align)
        elif op == 0x0A:  # remember_state (the CFA rule is part of the state, as in libgcc)
            self.saved.append(self.state.copy())
        elif op == 0x0B:  # restore_state
            if not self.saved:
                raise CfiDecodeError("restore_state without remember_state")
            self.state = self.saved.pop()
        elif op == 0x2E:  # GNU_args_size: only matters for exception landing pads
            r.uleb()
        elif op == 0x2D:  # GNU_window_save: SPARC only, nothing to do on x86_64
            pass
        else:
            return False
        return True

    def _cfa_op(self, op: int, r: Reader) -> bool:
        s = self.state
        data_align = self.cie.data_align
        if op == 0x0C:  # def_cfa: register, unfactored offset
            s.cfa_reg, s.cfa_offset, s.cfa_expr = r.uleb(), r.uleb(), None
        elif op == 0x12:  # def_cfa_sf: register, factored signed offset
            s.cfa_reg, s.cfa_offset, s.cfa_expr = r.uleb(), r.sleb() * data_align, None
        elif op == 0x0D:  # def_cfa_register
            s.cfa_reg, s.cfa_expr = r.uleb(), None
        elif op == 0x0E:  # def_cfa_offset: unfactored
            s.cfa_offset = r.uleb()
        elif op == 0x13:  # def_cfa_offset_sf: factored
            s.cfa_offset = r.sleb() * data_align
        elif op == 0x0F:  # def_cfa_expression
            s.cfa_reg, s.cfa_offset, s.cfa_expr = -1, 0, r.block(r.uleb())
        else:
            return False
        return True

    def _register_op(self, op: int, r: Reader) -> None:
        data_align = self.cie.data_align
        if op == 0x05:  # offset_extended
            self.set_reg(r.uleb(), RegRule(Kind.OFFSET, r.uleb() * data_align))
        elif op == 0x11:  # offset_extended_sf
            self.set_reg(r.uleb(), RegRule(Kind.OFFSET, r.sleb() * data_align))
        elif op == 0x2F:  # GNU_negative_offset_extended
            self.set_reg(r.uleb(), RegRule(Kind.OFFSET, -r.uleb() * data_align))
        elif op == 0x14:  # val_offset
            self.set_reg(r.uleb(), RegRule(Kind.VAL_OFFSET, r.uleb() * data_align))
        elif op == 0x15:  # val_offset_sf
            self.set_reg(r.uleb(), RegRule(Kind.VAL_OFFSET, r.sleb() * data_align))
        elif op == 0x06:  # restore_extended
            self.restore(r.uleb())
        elif op == 0x07:  # undefined
            self.set_reg(r.uleb(), RegRule(Kind.UNDEFINED))
        elif op == 0x08:  # same_value
            self.set_reg(r.uleb(), RegRule(Kind.SAME))
        elif op == 0x09:  # register
            self.set_reg(r.uleb(), RegRule(Kind.REGISTER, r.uleb()))
        elif op == 0x10:  # expression
            reg = r.uleb()
            self.set_reg(reg, RegRule(Kind.EXPRESSION, 0, r.block(r.uleb())))
        elif op == 0x16:  # val_expression
            reg = r.uleb()
            self.set_reg(reg, RegRule(Kind.VAL_EXPRESSION, 0, r.block(r.uleb())))
        else:
            raise CfiDecodeError(f"unknown call frame instruction {op:#x}")
