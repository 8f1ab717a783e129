"""The line-number program's opcodes, built by hand from DWARF 5 section 6.2.5."""

from __future__ import annotations

from qmpprof.dwarf.lineprogram import LineHeader, line_rows

# gcc's parameters for x86_64: line_base -5, line_range 14, opcode_base 13.
HEADER = LineHeader(
    min_instruction_length=1,
    max_ops_per_instruction=1,
    line_base=-5,
    line_range=14,
    opcode_base=13,
    standard_opcode_lengths=(0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1),
    address_size=8,
)


def special(address_step: int, line_step: int) -> int:
    return 13 + (line_step + 5) + 14 * address_step


def test_every_opcode_that_moves_a_row() -> None:
    code = bytes(
        [
            0x00, 9, 0x02, *(0x1000).to_bytes(8, "little"),  # DW_LNE_set_address 0x1000
            0x03, 0x09,  # DW_LNS_advance_line +9: line 10
            0x01,  # DW_LNS_copy: row (0x1000, 1, 10)
            0x05, 0x07,  # DW_LNS_set_column 7: skipped by its one operand
            0x06,  # DW_LNS_negate_stmt: no operand
            0x00, 2, 0x04, 0x03,  # DW_LNE_set_discriminator 3: skipped by its length
            special(4, 2),  # row (0x1004, 1, 12)
            0x04, 0x02,  # DW_LNS_set_file 2
            0x02, 0x10,  # DW_LNS_advance_pc 16
            0x03, 0x7D,  # DW_LNS_advance_line -3: line 9
            0x01,  # row (0x1014, 2, 9)
            0x08,  # DW_LNS_const_add_pc: (255 - 13) // 14 = 17
            0x09, 0x00, 0x01,  # DW_LNS_fixed_advance_pc 0x100
            special(0, 0),  # row (0x1125, 2, 9)
            0x00, 1, 0x01,  # DW_LNE_end_sequence: row (0x1125, 2, 0), registers reset
            special(1, -5),  # row (1, 1, -4): a new sequence starts from address 0, line 1
        ]
    )  # fmt: skip
    assert line_rows(code, HEADER) == [
        (0x1000, 1, 10),
        (0x1004, 1, 12),
        (0x1014, 2, 9),
        (0x1125, 2, 9),
        (0x1125, 2, 0),
        (1, 1, -4),
    ]


def test_instruction_length_and_operations_per_instruction_scale_the_address() -> None:
    vliw = LineHeader(4, 2, -5, 14, 13, HEADER.standard_opcode_lengths, 4)
    code = bytes(
        [
            0x00, 5, 0x02, *(0x100).to_bytes(4, "little"),  # a 4-byte DW_LNE_set_address
            special(1, 0),  # op_index 1: the address stays
            special(1, 0),  # op_index wraps to 0: one instruction of 4 bytes on
            0x02, 0x02,  # DW_LNS_advance_pc 2: 2 x 4 bytes
            0x01,
        ]
    )  # fmt: skip
    assert line_rows(code, vliw) == [(0x100, 1, 1), (0x104, 1, 1), (0x10C, 1, 1)]


def test_a_later_standard_opcode_is_skipped_by_its_declared_operands() -> None:
    # A producer's opcode_base of 14 declares opcode 13 with two ULEB128 operands.
    header = LineHeader(1, 1, -5, 14, 14, (*HEADER.standard_opcode_lengths, 2), 8)
    code = bytes([0x0D, 0x81, 0x01, 0x05, 0x01])  # opcode 13 (0x81 0x01 = 129, 5), copy
    assert line_rows(code, header) == [(0, 1, 1)]
