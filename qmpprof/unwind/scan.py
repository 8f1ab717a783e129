"""Code followed to its return: the caller of a frame whose code has no CFI, no symbol to
analyse its prologue by and no frame pointer (a stripped static program built without them).

The instruction set follows the code from the frame's pc to a return, tracking the stack
pointer (``InstructionSet.return_scan``); the return address is then read where the stack
pointer points. The scan is a heuristic, so its answer is checked before it is believed: a
return address in this module's code must lie right after a call instruction, or the walk ends
there (``StopReason.NO_CFI``) rather than invent frames. Code the scan cannot model, and a
return address outside this module's code (which it cannot check), leave the frame to the next
step (frame pointers).
"""

from __future__ import annotations

from qmpprof.arch.base import InstructionSet
from qmpprof.memo import Memo
from qmpprof.model import StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.steps import Outcome, Regs, Via, word_reader

_CALL_MAX = 7  # bytes of the longest call instruction is_call_before looks for
_CACHE_LIMIT = 1 << 14


class ReturnScanStep:
    """Follows the frame's code to its ``ret`` (``Via.SCAN``)."""

    via = Via.SCAN
    __slots__ = ("_checked", "arch", "bias", "code", "code_addr")

    def __init__(self, code: bytes, code_addr: int, bias: int, arch: InstructionSet) -> None:
        self.code = code
        self.code_addr = code_addr  # link address of code[0]
        self.bias = bias
        self.arch = arch
        self._checked: Memo[int, bool] = Memo(_CACHE_LIMIT)  # link ra -> after a call

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        arch = self.arch
        # A caller's pc is its return address - 1: the code to follow starts at the return.
        start = pc - self.bias + (0 if interrupted else 1)
        rule = arch.return_scan(self.code, self.code_addr, start)
        if rule is None:
            return None
        base = cur.get(arch.fp) if rule.from_fp else cur[arch.sp]
        if base is None:
            return None
        mask, read = arch.mask, word_reader(memory, arch)
        ra_slot = (base + rule.ra_offset) & mask
        ra = read(ra_slot)
        if ra is None:
            return StopReason.READ_FAILED
        after_call = self._after_call(ra)
        if after_call is None:
            return None  # another module's code: not ours to check, frame pointers then
        if not after_call:
            return StopReason.NO_CFI  # a wrong guess: stop here, truncated
        new = dict(cur)
        new[arch.pc], new[arch.sp] = ra, (ra_slot + arch.address_size) & mask
        if rule.fp_offset is not None:
            fp = read((base + rule.fp_offset) & mask)
            if fp is None:
                return StopReason.READ_FAILED
            new[arch.fp] = fp
        return new, False

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
