"""x86 code followed forward to its return: where a frame's return address is when its code has
neither CFI nor a symbol nor a frame pointer (stripped, static programs built without either).

From the frame's pc the scanner follows the instruction stream the way the function would run
to its end: it falls through conditional jumps (the other way is kept and tried when the first
dead-ends), follows direct unconditional jumps (a tail jump lands in a function that returns to
the same caller), steps over calls, and tracks the stack pointer (push, pop, i386's pushal and
popal, add/sub/lea rsp, ``leave`` and ``mov rsp, rbp`` through the frame pointer) until a
``ret``: the return address is
then at the tracked stack pointer; at an ``iret`` the frame the CPU pushed on a trap is there
(an interrupt entry's code: the caller is the interrupted code, its pc exact). It gives up
(None) on what it cannot model: the stack pointer set any other way (realignment), a jump
through a register or memory, code it cannot decode, a budget of instructions spent. A path
dead-ends at a trap instruction, a ``sysret`` or ``sysexit``, at padding or an
``endbr`` or a ``push`` right after a call (the call did not return: the code beyond is another
function's), or at code seen before (a loop); a return whose address or saved frame pointer lies
below the frame's stack pointer is not believed (the path ran into another function). A wrong
answer is still possible: the walker accepts a return address only where a call instruction ends
(``is_call_before``).

A function that never returns (a main loop ending in ``exit``, a die helper) has no return to
find. For it the scanner goes the other way (``from_entry``): from a start the function may
have (a direct call's target or a code pointer in the file's data: ``function_starts``), the
nearest below the pc first, it follows every path until one reaches the pc, the stack pointer
tracked from the entry, where the return address is. The answer names the start it assumed, so
that the walker can check it against the call that returns there.
"""

from __future__ import annotations

import re
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

from qmpprof.arch.base import ReturnRule
from qmpprof.memo import Memo

_BUDGET = 1000  # instructions decoded per scan, over all paths
_ENTRY_TRIES = 3  # function starts tried below a pc, the nearest first
_ENTRY_REACH = 1 << 16  # bytes from a start to the pc at most
_CHUNK = 64  # bytes decoded at a time along a path
_CACHE_LIMIT = 1 << 14
# The path ends: a trap, or a return to user code whose pc is in a register, not on the stack.
_TRAPS = frozenset(["int3", "hlt", "ud2", "ud1", "ud0", "sysret", "sysretq", "sysexit", "sysexitq"])
_IRET = frozenset(["iret", "iretd", "iretq"])
# After a call that did not return comes the next function: padding, or its prologue.
_AFTER_CALL_DEAD = frozenset(["nop", "int3", "endbr64", "endbr32", "hlt", "ud2", "push"])
_CONDITIONS = ("a", "ae", "b", "be", "e", "ne", "g", "ge", "l", "le", "o", "no", "p", "np",
               "s", "ns", "cxz", "ecxz", "rcxz")  # fmt: skip
_JCC = frozenset([*(f"j{c}" for c in _CONDITIONS), "loop", "loope", "loopne"])
_NOT_WRITES = frozenset(["cmp", "test", "push", "bt"])
_DEAD_END = "dead end"
# Instructions that take a code address, up to their 4-byte operand: (opening bytes, whether the
# operand is relative to the instruction's end). call rel32; mov r32, imm32 and mov r64, imm32
# (sign-extended); lea r64, [rip + disp32].
_TAKEN = (
    (re.compile(rb"\xe8"), True),
    (re.compile(rb"[\xb8-\xbf]"), False),
    (re.compile(rb"[\x48\x49]\xc7[\xc0-\xc7]"), False),
    (re.compile(rb"[\x48\x4c]\x8d[\x05\x0d\x15\x1d\x25\x2d\x35\x3d]"), True),
)


@dataclass(frozen=True, slots=True)
class _State:
    """The stack pointer as base + ``sp_off`` (base: the frame's stack pointer at the scan's
    start, or with ``sp_fp`` its frame pointer); the frame pointer as a register (base +
    ``fp_off``), as the word saved at base + ``fp_off`` ("mem"), or unknown."""

    sp_fp: bool = False
    sp_off: int = 0
    fp_kind: str = "reg"  # "reg", "mem" or "unknown"
    fp_fp: bool = True  # the frame pointer's base: its own start value
    fp_off: int = 0
    fp_saved: int | None = None  # where a push saved the frame pointer's start value

    @property
    def fp_untouched(self) -> bool:
        return self.fp_kind == "reg" and self.fp_fp and self.fp_off == 0


_Path = tuple[int, bool, _State]  # where a path goes on, whether right after a call, the stack


class ReturnScanner:
    """One answer per (code, pc), cached: the scan reads only the code, never registers."""

    def __init__(self, cs: object, word: int) -> None:
        self._cs = cs
        self._word = word
        sp, fp = ("rsp", "rbp") if word == 8 else ("esp", "ebp")
        self._sp, self._fp = sp, fp
        # Writes to a part of a register (ebp, bp, bpl in 64-bit code) change it all.
        parts = ("esp", "sp", "spl", "ebp", "bp", "bpl")
        self._sp_parts = tuple(f"{r}, " for r in parts[:3] if r != sp)
        self._fp_parts = tuple(f"{r}, " for r in parts[3:] if r != fp)
        self._lea = re.compile(rf"{sp}, \[({sp}|{fp})(?: ([+-]) (0x[0-9a-f]+|\d+))?\]")
        # (code, its address, pc, how: 0 to a return, 1 from the entry, 2 a caller's from the entry)
        self._cache: Memo[tuple[bytes, int, int, int], ReturnRule | None] = Memo(_CACHE_LIMIT)

    def scan(self, code: bytes, code_addr: int, pc: int) -> ReturnRule | None:
        key = (code, code_addr, pc, 0)
        try:
            return self._cache[key]
        except KeyError:
            return self._cache.put(key, self._scan(code, code_addr, pc, None))

    def from_entry(
        self, code: bytes, code_addr: int, pc: int, starts: Sequence[int], *, caller: bool
    ) -> ReturnRule | None:
        """The return address of a frame at ``pc`` found from its function's start: the first
        of ``starts`` (sorted) below ``pc`` from which a path reaches ``pc`` (at ``pc`` too,
        unless it is a ``caller``'s return address: a call that did not return ends there)."""
        key = (code, code_addr, pc, 1 + caller)
        try:
            return self._cache[key]
        except KeyError:
            pass
        found = None
        below = (bisect_left if caller else bisect_right)(starts, pc)
        for start in reversed(starts[max(0, below - _ENTRY_TRIES) : below]):
            if pc - start > _ENTRY_REACH:
                break
            found = self._scan(code, code_addr, start, pc)
            if found is not None:
                break
        return self._cache.put(key, found)

    def _scan(self, code: bytes, code_addr: int, pc: int, goal: int | None) -> ReturnRule | None:
        """From ``pc`` to a ``ret``; with ``goal``, from a function's start at ``pc`` to
        ``goal`` (a ``ret`` on the way ends that path)."""
        end = code_addr + len(code)
        pending: list[tuple[int, _State]] = [(pc, _State())]
        seen: set[int] = set()
        budget = _BUDGET
        while pending and budget > 0:
            addr, state = pending.pop()
            after_call = False
            while code_addr <= addr < end and addr not in seen and budget > 0:
                off = addr - code_addr
                insns = list(self._cs.disasm_lite(code[off : off + _CHUNK], addr))  # type: ignore[attr-defined]
                if not insns:
                    return None
                budget -= len(insns)
                outcome = self._run(insns, state, after_call, seen, pending, goal)
                if isinstance(outcome, str):  # _DEAD_END
                    break
                if isinstance(outcome, tuple):
                    addr, after_call, state = outcome
                    continue
                if outcome is None or goal is None:
                    return outcome
                return replace(outcome, entry=pc)  # the start it came from
        return None

    def _run(
        self,
        insns: list[tuple[int, int, str, str]],
        state: _State,
        after_call: bool,
        seen: set[int],
        pending: list[tuple[int, _State]],
        goal: int | None,
    ) -> ReturnRule | _Path | str | None:
        """Follow one decoded chunk: a rule at ``ret`` (or at ``goal``), None to give up,
        ``_DEAD_END``, or the path to go on with (the taken side of a conditional jump is left
        in ``pending``)."""
        for addr, _size, mnemonic, ops in insns:
            if addr == goal:
                return self._entry_rule(state) or _DEAD_END
            if addr in seen or (after_call and mnemonic in _AFTER_CALL_DEAD):
                return _DEAD_END
            seen.add(addr)
            after_call = mnemonic == "call"  # stepped over: it returns with the stack as it was
            if mnemonic.startswith("ret"):
                return (self._rule(state) if goal is None else None) or _DEAD_END
            if mnemonic in _IRET:
                rule = self._rule(state) if goal is None else None
                return _DEAD_END if rule is None else replace(rule, trap=True)
            if mnemonic in _TRAPS:
                return _DEAD_END
            if mnemonic == "jmp" or mnemonic in _JCC:
                try:
                    target = int(ops, 16)
                except ValueError:
                    return None  # through a register or memory: a switch, or a tail call
                if mnemonic == "jmp":
                    return target, False, state
                pending.append((target, state))
            elif not after_call:
                moved = self._track(state, mnemonic, ops)
                if moved is None:
                    return None
                state = moved
        last = insns[-1]
        return last[0] + last[1], after_call, state

    def _track(self, state: _State, mnemonic: str, ops: str) -> _State | None:
        """One instruction's effect on the stack and frame pointers; None: not modelled."""
        word, sp, fp = self._word, self._sp, self._fp
        if mnemonic in ("push", "pushfq", "pushfd"):
            pushed = replace(state, sp_off=state.sp_off - word)
            if ops == fp and state.fp_untouched and not state.sp_fp:
                return replace(pushed, fp_saved=pushed.sp_off)
            return pushed
        if mnemonic in ("pushal", "popal"):
            return self._all_registers(state, mnemonic == "pushal")
        if mnemonic in ("pop", "popfq", "popfd"):
            if ops == sp:
                return None
            popped = replace(state, sp_off=state.sp_off + word)
            if ops == fp:
                return replace(popped, fp_kind="mem", fp_fp=state.sp_fp, fp_off=state.sp_off)
            return popped
        if mnemonic == "leave":
            moved = self._sp_from_fp(state, 0)
            if moved is None:
                return None
            return replace(
                moved, sp_off=moved.sp_off + word, fp_kind="mem", fp_fp=moved.sp_fp,
                fp_off=moved.sp_off,
            )  # fmt: skip
        if mnemonic in _NOT_WRITES:
            return state
        if ops.startswith(f"{sp}, "):
            return self._set_sp(state, mnemonic, ops)
        if ops.startswith(self._sp_parts):
            return None
        if ops.startswith(f"{fp}, ") or ops.startswith(self._fp_parts):
            if mnemonic == "mov" and ops == f"{fp}, {sp}":
                return replace(state, fp_kind="reg", fp_fp=state.sp_fp, fp_off=state.sp_off)
            return replace(state, fp_kind="unknown")
        return state

    def _all_registers(self, state: _State, push: bool) -> _State:
        """i386's ``pushal`` and ``popal``: eight words (eax, ecx, edx, ebx, esp, ebp, esi, edi
        from the top), ebp two words above the lowest. A ``popal`` that takes back what a
        ``pushal`` of the untouched frame pointer saved leaves it untouched."""
        word = self._word
        if push:
            pushed = replace(state, sp_off=state.sp_off - 8 * word)
            if state.fp_untouched and not state.sp_fp:
                return replace(pushed, fp_saved=pushed.sp_off + 2 * word)
            return pushed
        at = state.sp_off + 2 * word
        popped = replace(state, sp_off=state.sp_off + 8 * word)
        if state.fp_untouched and not state.sp_fp and state.fp_saved == at:
            return popped
        return replace(popped, fp_kind="mem", fp_fp=state.sp_fp, fp_off=at)

    def _set_sp(self, state: _State, mnemonic: str, ops: str) -> _State | None:
        if mnemonic in ("add", "sub"):
            try:
                amount = int(ops.split(", ", 1)[1], 0)
            except ValueError:
                return None
            return replace(state, sp_off=state.sp_off + (amount if mnemonic == "add" else -amount))
        if mnemonic == "mov" and ops == f"{self._sp}, {self._fp}":
            return self._sp_from_fp(state, 0)
        if mnemonic == "lea" and (m := self._lea.fullmatch(ops)):
            delta = 0 if m[2] is None else int(m[3], 0) * (1 if m[2] == "+" else -1)
            if m[1] == self._sp:
                return replace(state, sp_off=state.sp_off + delta)
            return self._sp_from_fp(state, delta)
        return None  # `and rsp, -16`, `mov rsp, rax`: not modelled

    def _sp_from_fp(self, state: _State, delta: int) -> _State | None:
        """The stack pointer set from the frame pointer (+ ``delta``), when that is known."""
        if state.fp_kind != "reg":
            return None
        return replace(state, sp_fp=state.fp_fp, sp_off=state.fp_off + delta)

    def _rule(self, state: _State) -> ReturnRule | None:
        saved = state.fp_off if state.fp_kind == "mem" and state.fp_fp == state.sp_fp else None
        if state.fp_kind == "mem" and saved is None:
            return None
        if not state.sp_fp and (state.sp_off < 0 or (saved is not None and saved < 0)):
            return None  # a word saved below the frame's stack: the path ran into another function
        return ReturnRule(state.sp_fp, state.sp_off, saved)

    def _entry_rule(self, state: _State) -> ReturnRule | None:
        """At the goal, from the function's entry: the return address is where the stack
        pointer was at the entry; the caller's frame pointer is still in its register or where
        the function pushed it."""
        if state.sp_fp or state.sp_off > 0:
            return None
        if state.fp_untouched:
            saved = None
        elif state.fp_saved is not None:
            saved = state.fp_saved - state.sp_off
        else:
            return None
        return ReturnRule(False, -state.sp_off, saved)


def is_call_before(cs: object, code: bytes, ra: int) -> bool:
    """Whether the bytes before ``ra`` (``code`` ends there) decode as one call instruction:
    direct (e8 rel32) or through a register or memory (ff /2, 2 to 7 bytes with prefixes)."""
    for size in (5, 2, 3, 6, 7, 4):
        if len(code) < size:
            continue
        for _addr, insn_size, mnemonic, _ops in cs.disasm_lite(  # type: ignore[attr-defined]
            code[-size:], ra - size, 1
        ):
            if mnemonic == "call" and insn_size == size:
                return True
    return False


def function_starts(code: bytes, code_addr: int, data: Sequence[bytes], word: int) -> list[int]:
    """Where functions of ``code`` may start, sorted: the targets of its direct calls, the code
    addresses its instructions take (``mov reg, imm32``, as ``_start`` passes ``main``; ``lea
    reg, [rip + disp32]``) and the words of ``data`` (the file's data sections, read as aligned
    words) that point into it (function pointer tables). Every byte that opens such an
    instruction is read as one: a stray one seldom points into the code, and ``from_entry``
    keeps a start only if a path from it reaches the pc."""
    end = code_addr + len(code)
    found: set[int] = set()
    for pattern, relative in _TAKEN:
        for at in pattern.finditer(code):
            i = at.end()
            if i + 4 <= len(code):
                value = struct.unpack_from("<i" if relative else "<I", code, i)[0]
                target = code_addr + i + 4 + value if relative else value
                if code_addr <= target < end:
                    found.add(target)
    fmt = "<Q" if word == 8 else "<I"
    for raw in data:
        usable = len(raw) - len(raw) % word
        found.update(
            value for (value,) in struct.iter_unpack(fmt, raw[:usable]) if code_addr <= value < end
        )
    return sorted(found)
