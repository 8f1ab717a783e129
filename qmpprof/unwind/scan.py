"""Code followed to its return: the caller of a frame whose code has no CFI, no symbol to
analyse its prologue by and no frame pointer (a stripped static program built without them).

The instruction set follows the code from the frame's pc to a return, tracking the stack
pointer (``InstructionSet.return_scan``); the return address is then read where the stack
pointer points. The scan is a heuristic, so its answer is checked before it is believed: a
return address in this module's code must lie right after a call instruction, or the walk ends
there (``StopReason.NO_CFI``) rather than invent frames. Code the scan cannot model, and a
return address outside this module's code (which it cannot check), leave the frame to the next
step (frame pointers).

A function that never returns (every path ends in a call to ``exit`` or a die helper) is
followed from its start instead (``InstructionSet.return_from_entry``), the start guessed from
the module's direct calls and code pointers (``function_starts``, worked out once per file, the
first time a frame needs it): then a direct call that returns there must call that start.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from qmpprof.arch.base import InstructionSet, ReturnRule
from qmpprof.memo import Memo
from qmpprof.model import StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.steps import EXACT, Outcome, Regs, Via, caller, word_reader

_CALL_MAX = 7  # bytes of the longest call instruction is_call_before looks for
_CACHE_LIMIT = 1 << 14


class ReturnScanStep:
    """Follows the frame's code to its ``ret`` (``Via.SCAN``). ``traps_only``: answers only for
    interrupted code that returns from a trap (an interrupt entry caught at its first
    instructions, which prologue analysis would take for a function called there)."""

    via = Via.SCAN
    __slots__ = ("_checked", "arch", "bias", "code", "code_addr", "starts", "traps_only")

    def __init__(
        self,
        code: bytes,
        code_addr: int,
        bias: int,
        arch: InstructionSet,
        starts: Callable[[], Sequence[int]] | None = None,
        *,
        traps_only: bool = False,
    ) -> None:
        self.code = code
        self.code_addr = code_addr  # link address of code[0]
        self.bias = bias
        self.arch = arch
        self.starts = starts  # where functions may start (the file keeps its answer)
        self.traps_only = traps_only
        self._checked: Memo[int, bool] = Memo(_CACHE_LIMIT)  # link ra -> after a call

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        # A caller's pc is its return address - 1: the code to follow starts at the return.
        start = pc - self.bias + (0 if interrupted else 1)
        if self.traps_only:
            if not interrupted:
                return None
            rule = self.arch.return_scan(self.code, self.code_addr, start)
            if rule is None or not rule.trap:
                return None
            found = self._follow(rule, cur, memory)
            return found if isinstance(found, tuple) else None  # not a trap: the next steps
        outcome: Outcome = None
        for rule in self._rules(start, interrupted):
            outcome = self._follow(rule, cur, memory)
            if outcome is not StopReason.NO_CFI:
                return outcome
        return outcome  # None: no rule; NO_CFI: each was a wrong guess, the walk stops

    def _follow(self, rule: ReturnRule, cur: Regs, memory: PageCache) -> Outcome:
        arch = self.arch
        base = cur.get(arch.fp) if rule.from_fp else cur[arch.sp]
        if base is None:
            return None
        mask, read = arch.mask, word_reader(memory, arch)
        ra_slot = (base + rule.ra_offset) & mask
        if rule.trap:
            return self._trap(rule, base, ra_slot, cur, memory)
        signed = read(ra_slot)
        if signed is None:
            return StopReason.READ_FAILED
        ra = arch.return_address(signed) or signed  # a pointer-authentication code taken off
        after_call = self._after_call(ra)
        if after_call is None:
            return None  # another module's code: not ours to check, frame pointers then
        if not after_call or not self._calls_entry(ra, rule):
            return StopReason.NO_CFI  # a wrong guess: stop here, truncated
        fp_slot = None if rule.fp_offset is None else base + rule.fp_offset
        return caller(cur, arch, ra, (ra_slot + arch.address_size) & mask, fp_slot, read)

    def _trap(
        self, rule: ReturnRule, base: int, slot: int, cur: Regs, memory: PageCache
    ) -> Outcome:
        """The interrupted code's registers from the frame the CPU pushed at ``slot``."""
        arch = self.arch
        read = word_reader(memory, arch)
        if read(slot) is None:
            return StopReason.READ_FAILED
        frame = arch.trap_return(slot, read)
        if frame is None:
            return StopReason.NO_CFI  # no trap frame there: a wrong guess
        pc, sp = frame
        fp_slot = None if rule.fp_offset is None else base + rule.fp_offset
        found = caller(cur, arch, pc, sp, fp_slot, read)
        return found if not isinstance(found, tuple) else (found[0], EXACT)

    def _rules(self, start: int, interrupted: bool) -> Iterator[ReturnRule]:
        """Where the return address may be: by the code to a return, then from the function's
        entry. A caller whose return address is where a function starts called one that does
        not return: the code there is the next function's, not its own to follow."""
        arch, code, code_addr = self.arch, self.code, self.code_addr
        starts = None if self.starts is None else self.starts()
        after_noreturn = not interrupted and starts is not None and _holds(starts, start)
        if not after_noreturn and (rule := arch.return_scan(code, code_addr, start)) is not None:
            yield rule
        if starts is not None:
            rule = arch.return_from_entry(code, code_addr, start, starts, caller=not interrupted)
            if rule is not None:
                yield rule

    def _calls_entry(self, ra: int, rule: ReturnRule) -> bool:
        """Whether a rule found from a function's start agrees with the call returning to
        ``ra``: a direct call must call that start (an indirect one cannot be checked)."""
        if rule.entry is None:
            return True
        link = ra - self.bias
        off = link - self.code_addr
        target = self.arch.call_before(self.code[max(0, off - _CALL_MAX) : off], link)
        return target is None or target == rule.entry

    def _after_call(self, ra: int) -> bool | None:
        """Whether ``ra`` lies right after a call instruction; None: not in this module's code
        (another module's, or none: the scan cannot tell)."""
        link = ra - self.bias
        off = link - self.code_addr
        if not _CALL_MAX <= off <= len(self.code):
            return None
        try:
            return self._checked[link]
        except KeyError:
            code = self.code[off - _CALL_MAX : off]
            return self._checked.put(link, self.arch.is_call_before(code, link))


def _holds(ordered: Sequence[int], value: int) -> bool:
    at = bisect_left(ordered, value)
    return at < len(ordered) and ordered[at] == value
