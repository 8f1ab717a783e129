"""x86 code followed from a pc straight to a direct call, with what it pushes on the way: how
much of a trap frame a kernel's entry code has built when the CPU stopped inside it.

A trap entry without CFI (a vector stub that pushes an error code and the trap's number, then
jumps to a common entry that pushes the segment registers and ``pushal``, then calls the handler
with the frame's address) builds its frame with pushes only. Followed from the stopped pc to the
handler's call, the pushes still to come say where the frame will lie, and so where the part the
CPU pushed lies now. A pushed register holds its value at the pc unless the way there wrote it
first (an instruction naming it as its first operand, ``xchg``'s second too; one that writes
registers it does not name counts as writing them all); ``push esp`` and ``pushal`` push the
stack pointer as it was before the instruction, and a register set from it (``mov reg, esp``,
``lea reg, [esp + n]``) and pushed unchanged pushes that stack address; one still holding it at
the call is said so (x86_64's handler takes the frame's address in rdi). A pop or any other
write to the stack pointer, a conditional or indirect jump, another call, a return or a trap
instruction ends the way with no answer, as does a way longer than any entry's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from qmpprof.arch.base import PathToCall
from qmpprof.arch.x86code import analyzer

_BUDGET = 64  # instructions followed: an entry's way to its handler is a few dozen at most
_CHUNK = 32  # bytes decoded at a time
_PUSHAL = ("eax", "ecx", "edx", "ebx", "esp", "ebp", "esi", "edi")  # pushed in this order
_FLAGS = {4: "pushfd", 8: "pushfq"}  # a word of flags (pushf alone: 16 bits)
_SMALL = {"ax": ("al", "ah"), "bx": ("bl", "bh"), "cx": ("cl", "ch"), "dx": ("dl", "dh"),
          "si": ("sil",), "di": ("dil",), "bp": ("bpl",), "sp": ("spl",)}  # fmt: skip
# Every name of a part of a general register -> the register (its stem: "ax" for al..rax).
_PARTS = {
    name: stem for stem, small in _SMALL.items() for name in (stem, f"e{stem}", f"r{stem}", *small)
} | {f"r{n}{s}": f"r{n}" for n in range(8, 16) for s in ("", "d", "w", "b")}
_WORDS = frozenset(f"r{n}w" for n in range(8, 16))  # x86_64's other 16-bit registers
_NOT_WRITES = frozenset(["cmp", "test", "bt", "nop", "cli", "sti", "cld", "std", "lfence"])
_BOTH_WRITTEN = frozenset(["xchg", "xadd", "cmpxchg"])
# Instructions that write registers they do not name (mul's edx:eax, lodsd's esi, cpuid's four).
_UNNAMED = ("mul", "imul", "div", "idiv", "c", "rd", "xlat", "lahf", "lods", "stos", "movs", "rep")
_ALL = frozenset(stem for stem in _PARTS.values() if stem != "sp")
_ENDS = ("j", "ret", "iret", "int", "pop", "leave", "enter", "sys", "hlt", "ud", "loop")
# A register set to a stack address: "eax, esp", "rax, [rsp + 0x10]" (capstone's Intel syntax).
_FROM_SP = re.compile(r"(\w+), (?:[er]sp|\[[er]sp(?: ([+-]) (\w+))?\])$")


@dataclass(slots=True)
class _Way:
    depth: int = 0
    saved: list[tuple[int, int]] = field(default_factory=list)
    addresses: list[tuple[int, int]] = field(default_factory=list)
    written: set[str] = field(default_factory=set)
    held: dict[str, int] = field(default_factory=dict)  # register stem -> the stack address


def path_to_call(
    word: int, names: Sequence[str], code: bytes, code_addr: int, pc: int, target: int
) -> PathToCall | None:
    """See ``InstructionSet.path_to_call``; ``names``: the registers' names by DWARF number."""
    disasm = analyzer(word).disasm
    way, budget, addr, end = _Way(), _BUDGET, pc, code_addr + len(code)
    while budget > 0 and code_addr <= addr < end:
        off = addr - code_addr
        insns = list(disasm(code[off : off + _CHUNK], addr))
        if not insns:
            return None
        for at, size, mnemonic, ops in insns:
            budget -= 1
            addr = at + size
            if mnemonic == "call":
                if ops != hex(target):
                    return None
                held = tuple(
                    (names.index(name), offset)
                    for stem, offset in way.held.items()
                    if (name := _whole(stem, word)) in names
                )
                written = frozenset(
                    names.index(name)
                    for stem in way.written
                    if (name := _whole(stem, word)) in names
                )
                return PathToCall(way.depth, tuple(way.saved), tuple(way.addresses), held, written)
            if mnemonic == "jmp":
                if not ops.startswith("0x"):
                    return None
                addr = int(ops, 16)
                break
            if not _follow(way, mnemonic, ops, word, names):
                return None
    return None


def _whole(stem: str, word: int) -> str:
    """The whole register of a stem for this word size: ``di`` -> ``rdi`` or ``edi``."""
    return stem if stem.startswith("r") and stem[1:].isdigit() else "re"[word == 4] + stem


def _follow(way: _Way, mnemonic: str, ops: str, word: int, names: Sequence[str]) -> bool:
    """One instruction's pushes and writes; False: the way ends here, unanswered."""
    if mnemonic == "push" and (ops in _SMALL or ops in _WORDS):
        return False  # a 16-bit register: two bytes, not a stack word
    if mnemonic in ("push", "pushal", _FLAGS[word]):
        before = -way.depth  # the stack pointer before the instruction, from the pc's
        for reg in _PUSHAL if mnemonic == "pushal" else (ops,) if mnemonic == "push" else ("",):
            way.depth += word
            stem = _PARTS.get(reg)
            if stem == "sp":
                way.addresses.append((-way.depth, before))
            elif stem in way.held:
                way.addresses.append((-way.depth, way.held[stem]))
            elif reg in names and stem not in way.written:
                way.saved.append((-way.depth, names.index(reg)))
        return True
    if mnemonic.startswith(_ENDS):
        return False
    if mnemonic in _NOT_WRITES:
        return True
    if not ops or mnemonic.startswith(_UNNAMED):
        way.written.update(_ALL)
    operands = ops.split(", ")
    named = operands if mnemonic in _BOTH_WRITTEN else operands[:1]
    stems = {_PARTS[op] for op in named if op in _PARTS}
    way.written.update(stems)
    for stem in stems:
        way.held.pop(stem, None)
    taken = _FROM_SP.match(ops) if mnemonic in ("mov", "lea") else None
    # Into a whole register of this instruction set (not ax, not x86_64's eax or r8d).
    if taken and operands[0] in names and (mnemonic == "lea") == ("[" in ops):
        offset = 0 if taken[3] is None else int(taken[3], 0) * (-1 if taken[2] == "-" else 1)
        way.held[_PARTS[operands[0]]] = -way.depth + offset
    return "sp" not in way.written
