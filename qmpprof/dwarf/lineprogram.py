"""The DWARF line-number program (.debug_line, DWARF 2 to 5): its opcodes run into rows.

Only the opcode stream is decoded here; the header (file names, the opcode parameters) is
read by whoever found the program. A kernel unit's program runs to tens of thousands of rows:
pyelftools keeps a copied state object per row and parses each byte through ``construct``,
half a second a unit, where this loop keeps the three registers --lines reads in locals.
"""

from __future__ import annotations

from dataclasses import dataclass

from qmpprof.dwarf.encoding import Reader

_LNS_COPY, _LNS_ADVANCE_PC, _LNS_ADVANCE_LINE, _LNS_SET_FILE = 1, 2, 3, 4
_LNS_CONST_ADD_PC, _LNS_FIXED_ADVANCE_PC = 8, 9
_LNE_END_SEQUENCE, _LNE_SET_ADDRESS = 1, 2

Row = tuple[int, int, int]  # (address, file index, line); line 0 closes a sequence


@dataclass(frozen=True, slots=True)
class LineHeader:
    """The header fields that drive the opcodes (DWARF 5 section 6.2.4)."""

    min_instruction_length: int
    max_ops_per_instruction: int  # 1 before DWARF 4, which has no such field
    line_base: int
    line_range: int
    opcode_base: int
    standard_opcode_lengths: tuple[int, ...]
    address_size: int


def line_rows(code: bytes, header: LineHeader) -> list[Row]:
    """The rows of a program whose opcodes are ``code``, in the program's order."""
    r = Reader(code, address_size=header.address_size)
    rows: list[Row] = []
    address, op_index, file, line = 0, 0, 1, 1
    min_length, max_ops = header.min_instruction_length, header.max_ops_per_instruction
    opcode_base, line_base, line_range = header.opcode_base, header.line_base, header.line_range
    end = len(code)
    while r.pos < end:
        opcode = code[r.pos]
        r.pos += 1
        if opcode >= opcode_base:  # special opcode: advance address and line, add a row
            advance, line_step = divmod(opcode - opcode_base, line_range)
            op_index, steps = (op_index + advance) % max_ops, (op_index + advance) // max_ops
            address += min_length * steps
            line += line_base + line_step
            rows.append((address, file, line))
        elif opcode == 0:  # extended opcode: its length, then the opcode and its operands
            length = r.uleb()
            after = r.pos + length
            extended = r.u8()
            if extended == _LNE_END_SEQUENCE:
                rows.append((address, file, 0))
                address, op_index, file, line = 0, 0, 1, 1
            elif extended == _LNE_SET_ADDRESS:
                address = r.address()
            # DW_LNE_define_file (DWARF 2-4, which gcc and clang never emit), set_discriminator
            # and vendor opcodes change nothing --lines reads: skipped by their length.
            r.pos = after
        elif opcode == _LNS_COPY:
            rows.append((address, file, line))
        elif opcode == _LNS_ADVANCE_PC:
            address += r.uleb() * min_length
        elif opcode == _LNS_ADVANCE_LINE:
            line += r.sleb()
        elif opcode == _LNS_SET_FILE:
            file = r.uleb()
        elif opcode == _LNS_CONST_ADD_PC:
            address += (255 - opcode_base) // line_range * min_length
        elif opcode == _LNS_FIXED_ADVANCE_PC:
            address += r.u16()
        else:  # the rest (columns, flags, ISA, later opcodes): skip their ULEB128 operands
            for _ in range(header.standard_opcode_lengths[opcode - 1]):
                r.uleb()
    return rows
