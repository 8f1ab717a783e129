"""A DWARF expression (DW_OP_*) stack machine for CFI rules.

Used for DW_CFA_def_cfa_expression (PLT stubs, kernel entry code), DW_CFA_expression and
DW_CFA_val_expression (signal/trap frames). Only the operations meaningful in call-frame
information are supported; anything else makes the rule unusable (result None), so the
unwinder truncates the stack instead of guessing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qmpprof.dwarf.encoding import MASK64, CfiDecodeError, Reader

ReadU64 = Callable[[int], "int | None"]
ReadBytes = Callable[[int, int], "bytes | None"]

# Cap on executed operations: DW_OP_bra/skip can loop forever in hostile input.
_MAX_STEPS = 1000

_CONST_SIZES = {
    0x08: (1, False),  # const1u
    0x09: (1, True),  # const1s
    0x0A: (2, False),  # const2u
    0x0B: (2, True),  # const2s
    0x0C: (4, False),  # const4u
    0x0D: (4, True),  # const4s
    0x0E: (8, False),  # const8u
    0x0F: (8, True),  # const8s
}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def _binary(op: int, a: int, b: int) -> int | None:
    """Apply a two-operand op: ``a`` was pushed first, ``b`` is the top of the stack."""
    sa, sb = _signed(a), _signed(b)
    if op == 0x1A:
        return a & b
    if op == 0x1B:
        return None if sb == 0 else int(sa / sb)
    if op == 0x1C:
        return a - b
    if op == 0x1D:
        return None if b == 0 else a % b
    if op == 0x1E:
        return a * b
    if op == 0x21:
        return a | b
    if op == 0x22:
        return a + b
    if op == 0x24:
        return a << b if b < 64 else 0
    if op == 0x25:
        return a >> b if b < 64 else 0
    if op == 0x26:
        return sa >> min(b, 63)
    if op == 0x27:
        return a ^ b
    compare = {0x29: sa == sb, 0x2A: sa >= sb, 0x2B: sa > sb, 0x2C: sa <= sb, 0x2D: sa < sb}
    if op in compare:
        return int(compare[op])
    if op == 0x2E:
        return int(sa != sb)
    return None


def evaluate(
    expr: bytes,
    regs: Mapping[int, int],
    read_u64: ReadU64,
    push: int | None = None,
    address_size: int = 8,
    read_bytes: ReadBytes | None = None,
) -> int | None:
    """Run ``expr``; ``push`` (the CFA for DW_CFA_expression rules) starts on the stack.

    Returns the top of the stack, or None if the expression is malformed, uses an unknown
    operation, names a register we do not know, or dereferences unreadable memory.
    ``memory.PageMissing`` from ``read_u64`` propagates so that the sampler can fetch the page.
    ``address_size`` 4 (i386): DW_OP_addr and DW_OP_deref take 4 bytes, the result 32 bits.
    With ``read_bytes`` (address, size), a dereference reads exactly its size, so a 4-byte
    word at the end of a page never asks for the next one; without it, it reads 8 and masks.
    """
    stack: list[int] = [] if push is None else [push]
    try:
        reader = Reader(expr, address_size=address_size)
        value = _run(reader, stack, regs, read_u64, read_bytes)
    except (CfiDecodeError, IndexError, KeyError):
        return None
    return None if value is None else value & ((1 << (8 * address_size)) - 1)


def _run(
    r: Reader,
    stack: list[int],
    regs: Mapping[int, int],
    read_u64: ReadU64,
    read_bytes: ReadBytes | None,
) -> int | None:
    steps = 0
    while r.pos < len(r.data):
        steps += 1
        if steps > _MAX_STEPS:
            return None
        op = r.u8()
        if 0x30 <= op <= 0x4F:  # lit0..lit31
            stack.append(op - 0x30)
        elif 0x50 <= op <= 0x6F:  # reg0..reg31: the register's value
            stack.append(regs[op - 0x50])
        elif 0x70 <= op <= 0x8F:  # breg0..breg31: register + sleb offset
            stack.append((regs[op - 0x70] + r.sleb()) & MASK64)
        elif op == 0x90:  # regx
            stack.append(regs[r.uleb()])
        elif op == 0x92:  # bregx
            reg = r.uleb()
            stack.append((regs[reg] + r.sleb()) & MASK64)
        elif op in _CONST_SIZES:
            size, signed = _CONST_SIZES[op]
            value = int.from_bytes(r.block(size), "little", signed=signed)
            stack.append(value & MASK64)
        elif op in (0x03, 0x10, 0x11):  # addr, constu, consts
            value = r.address() if op == 0x03 else r.uleb() if op == 0x10 else r.sleb()
            stack.append(value & MASK64)
        elif op in (0x06, 0x94):  # deref, deref_size
            size = r.address_size if op == 0x06 else r.u8()
            if not 1 <= size <= 8:
                return None
            loaded = _deref(stack.pop(), size, read_u64, read_bytes)
            if loaded is None:
                return None
            stack.append(loaded)
        elif not _stack_op(op, r, stack):
            return None
    return stack[-1] & MASK64 if stack else None


def _deref(addr: int, size: int, read_u64: ReadU64, read_bytes: ReadBytes | None) -> int | None:
    if read_bytes is not None:
        data = read_bytes(addr, size)
        return None if data is None else int.from_bytes(data, "little")
    loaded = read_u64(addr)
    return None if loaded is None else loaded & ((1 << (8 * size)) - 1)


def _stack_op(op: int, r: Reader, stack: list[int]) -> bool:
    """Operations that only shuffle or combine stack values; False for an unknown op."""
    if op == 0x12:  # dup
        stack.append(stack[-1])
    elif op == 0x13:  # drop
        stack.pop()
    elif op == 0x14:  # over
        stack.append(stack[-2])
    elif op == 0x15:  # pick
        stack.append(stack[-1 - r.u8()])
    elif op == 0x16:  # swap
        stack[-1], stack[-2] = stack[-2], stack[-1]
    elif op == 0x17:  # rot: top three rotate, top goes third
        stack[-3], stack[-2], stack[-1] = stack[-1], stack[-3], stack[-2]
    elif op == 0x19:  # abs
        stack.append(abs(_signed(stack.pop())) & MASK64)
    elif op == 0x1F:  # neg
        stack.append(-stack.pop() & MASK64)
    elif op == 0x20:  # not
        stack.append(~stack.pop() & MASK64)
    elif op == 0x23:  # plus_uconst
        stack.append((stack.pop() + r.uleb()) & MASK64)
    elif op == 0x2F:  # skip
        _jump(r, r.s16())
    elif op == 0x28:  # bra: branch if the popped value is non-zero
        delta = r.s16()
        if stack.pop():
            _jump(r, delta)
    elif op == 0x96:  # nop
        pass
    else:
        b = stack.pop()
        a = stack.pop()
        result = _binary(op, a, b)
        if result is None:
            return False
        stack.append(result & MASK64)
    return True


def _jump(r: Reader, delta: int) -> None:
    target = r.pos + delta
    if not 0 <= target <= len(r.data):
        raise CfiDecodeError("branch outside the expression")
    r.pos = target
