"""Tail-call frames recovered from machine code, the way gdb makes them up from DWARF call sites.

A function that ends in ``jmp other`` is no longer on the stack while ``other`` runs: a walk
(ORC, CFI, frame pointers) goes from ``other`` straight to the function that called the
jumper. gdb shows the jumper anyway, as a ``TAILCALL_FRAME`` (``dwarf2/frame-tailcall.c``),
when DWARF call sites make the path unique. This module finds the same frames without DWARF,
from the code bytes and the function symbols (kallsyms) alone:

- the caller's return address ``ra`` follows a direct ``call T`` (the instruction set reads
  it: ``InstructionSet.call_before``; on x86 e8 rel32). When the callee
  frame's function ``F`` is ``T`` there is nothing to add; an indirect call (a retpoline thunk)
  or a static call (a trampoline with no DWARF) has no known target: gdb adds nothing either;
- otherwise ``T`` reached ``F`` by tail jumps: every path of direct jumps (``jmp``/``jcc`` to
  another function's first byte, ``InstructionSet.branches``) from ``T`` to ``F`` is a
  candidate, searched depth first as gdb's ``call_site_find_chain_2`` does (a jump site is not
  used twice on one path). The candidates are intersected like ``chain_candidate``: the sites
  all paths share from the top (callers) and from the bottom (callees) are kept; nothing is
  left when the candidates share neither end, or a direct path competes with a longer one;
- a function that is nothing but a jump out of itself (landing pads and no-ops before it:
  ``InstructionSet.lone_jump``; arm64's ``memset``, ``bti c; b __pi_memset_generic``) is
  crossed but never made a frame: gdb has no call site in it to make one from, and the frame
  would name an instruction it never ran. A function whose first jump lands in itself (a
  static key's) is read whole: so every frame put back ends in the jump its function ran;
- a search that meets what gdb cannot follow gives up, as gdb's throws do: an indirect tail
  jump (through a thunk or a register), a jump to code without DWARF (a static-call trampoline).

A tail-call frame's pc is the address after its jump (gdb's ``call_site->pc ()``): looked up
at pc - 1 like a return address, it names the jumper. Frames come innermost first, the
jumper of ``F`` first. Addresses are runtime ones; ``CodeImage.bias`` maps them to the link
addresses of the code and symbols (the KASLR slide, a module's load address). Which symbols
are thunks and trampolines (``TargetKind``) the code's provider says (``CodeImage.kind``).

Measured against gdb on Debian's 6.12 and 6.1 (docs/linux-guest.md): 173 of 173 of gdb's
tail-call frames, each where gdb has it; the frames found that gdb lacks are tail jumps gdb
itself says it cannot make (an inline-asm caller, a callee also inlined elsewhere, assembly).
"""

from __future__ import annotations

import enum
import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.symbols import SymbolTable
from qmpprof.memo import Memo

_COLD = re.compile(r"^(.+)\.cold(?:\.\d+)?$")  # gcc's unlikely part of a function
_CALL_SIZE = 16  # bytes before a return address handed to call_before (the longest call)
MAX_SITES = 64  # jump sites one search may enter: bounds its time (x64_sys_call has 357)


class TargetKind(enum.Enum):
    """What a jump or call to a symbol means for the search."""

    FUNCTION = "function"  # a function gdb has DWARF for: followed
    INDIRECT = "indirect"  # a retpoline thunk: the real target is in a register
    RETURN = "return"  # a return thunk: ``jmp __x86_return_thunk`` is a ``ret``
    OPAQUE = "opaque"  # code without DWARF (a static-call trampoline): gdb gives up there


class Outcome(enum.Enum):
    """Why a search added the frames it did (for measurements)."""

    FOUND = "found"  # tail-call frames added
    DIRECT = "direct"  # the call's target is the callee: nothing to add
    UNKNOWN_CALL = "unknown-call"  # no direct call before ra, or an indirect/opaque one
    NO_PATH = "no-path"  # no jumps lead from the call's target to the callee
    AMBIGUOUS = "ambiguous"  # several paths that share no end
    GAVE_UP = "gave-up"  # an indirect or opaque jump on the way, or the search was too long


@dataclass(frozen=True, slots=True)
class Chain:
    """The tail-call frames between a callee and its caller, innermost first."""

    pcs: tuple[int, ...]
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class _Site:
    pc: int  # the address after the jump (runtime)
    target: int  # the jump's target (runtime)
    frame: bool = True  # False: the jumper is only this jump (``lone_jump``), never a frame


class _GiveUp(Exception):
    """A search met what gdb cannot follow."""


@dataclass(eq=False)
class CodeImage:
    """One module's code: ``data`` at link address ``addr``, in instruction set ``arch``, its
    function symbols at link addresses, and ``bias`` = runtime - link address. ``kind`` sorts
    targets by name."""

    addr: int
    data: bytes
    functions: SymbolTable
    kind: Callable[[str], TargetKind]
    arch: InstructionSet
    bias: int = 0
    _starts: list[int] = field(default_factory=list, init=False, repr=False)
    _ends: list[int] = field(default_factory=list, init=False, repr=False)
    _names: list[str] = field(default_factory=list, init=False, repr=False)
    _parts: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _cold: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        # The symbol table's own lists, shared: copying 10^5 symbols took a third of a second
        # of every run's start-up.
        self._starts, self._ends, self._names = self.functions.columns()
        # A ".cold" part belongs to its function (gdb's DWARF function has both ranges); only
        # a name that one function has can be matched. Few names are cold parts: only their
        # parents' names are counted.
        cold = [
            (start, found[1])
            for start, name in zip(self._starts, self._names, strict=True)
            if ".cold" in name and (found := _COLD.match(name)) is not None
        ]
        wanted = {parent for _, parent in cold}
        starts_of: dict[str, list[int]] = {}
        for start, name in zip(self._starts, self._names, strict=True):
            if name in wanted:
                starts_of.setdefault(name, []).append(start)
        for start, name in cold:
            parent = starts_of.get(name)
            if parent is not None and len(parent) == 1:
                self._parts[start] = parent[0]
                self._cold.setdefault(parent[0], []).append(start)

    def holds(self, pc: int) -> bool:
        link = (pc - self.bias) & self.arch.mask
        return self.addr <= link < self.addr + len(self.data)

    def function(self, pc: int) -> tuple[int, int, str] | None:
        """(start, end, name) of the symbol covering runtime ``pc``, at runtime addresses."""
        link = (pc - self.bias) & self.arch.mask
        i = bisect_right(self._starts, link) - 1
        if i < 0 or link >= self._ends[i]:
            return None
        return self._starts[i] + self.bias, self._ends[i] + self.bias, self._names[i]

    def owner(self, start: int) -> int:
        """The function a symbol is part of: its parent for a ``.cold`` part, else itself."""
        link = start - self.bias
        return self._parts.get(link, link) + self.bias

    def parts(self, start: int) -> list[int]:
        """The symbol starts of the function at ``start``: it and its ``.cold`` parts."""
        return [start] + [part + self.bias for part in self._cold.get(start - self.bias, ())]

    def code(self, start: int, end: int) -> bytes:
        """The bytes at runtime addresses [start, end), empty when they start outside."""
        low = start - self.bias - self.addr
        return b"" if low < 0 else self.data[low : end - self.bias - self.addr]


class TailCallFinder:
    """Searches the code of one address space (the kernel and its modules) for tail-call
    frames; caches each function's jump sites."""

    @classmethod
    def of(cls, images: Sequence[CodeImage]) -> TailCallFinder:
        """The one finder of these images (made once, its caches shared by everyone)."""
        key = tuple(images)
        found = _FINDERS.get(key)
        if found is None:
            found = _FINDERS.put(key, cls(images))
        return found

    def __init__(self, images: Sequence[CodeImage]) -> None:
        self.images = list(images)
        self._sites: Memo[int, tuple[_Site, ...] | None] = Memo()
        self._chains: Memo[tuple[int, int], Chain] = Memo()  # (ra, callee's function) -> frames

    def image(self, pc: int) -> CodeImage | None:
        return next((image for image in self.images if image.holds(pc)), None)

    def _function(self, pc: int) -> tuple[CodeImage, int, str] | None:
        """The image, function start (a ``.cold`` part's parent) and name of ``pc``."""
        image = self.image(pc)
        found = None if image is None else image.function(pc)
        if image is None or found is None:
            return None
        return image, image.owner(found[0]), found[2]

    def call_target(self, ra: int) -> int | None:
        """The function a direct ``call rel32`` ending at ``ra`` calls, None when the
        instruction before ``ra`` is no such call or its target is no function we follow."""
        image = self.image(ra - 1)
        if image is None:
            return None
        before = image.code(max(ra - _CALL_SIZE, image.addr + image.bias), ra)
        target = image.arch.call_before(before, ra)
        found = None if target is None else self._function(target)
        if target is None or found is None or found[1] != target:
            return None  # not a function's first byte: not a call we can read
        return target if found[0].kind(found[2]) is TargetKind.FUNCTION else None

    def between(self, ra: int, callee_pc: int) -> Chain:
        """The tail-call frames between a caller's return address and the frame of the
        callee (``callee_pc``: a lookup address, inside the callee's function)."""
        target = self.call_target(ra)
        callee = self._function(callee_pc)
        if target is None or callee is None:
            return Chain((), Outcome.UNKNOWN_CALL)
        if target == callee[1]:
            return Chain((), Outcome.DIRECT)
        key = (ra, callee[1])
        found = self._chains.get(key)
        if found is None:
            try:
                found = _Search(self, callee[1]).run(target)
            except _GiveUp:
                found = Chain((), Outcome.GAVE_UP)
            self._chains.put(key, found)
        return found

    def sites(self, start: int) -> tuple[_Site, ...]:
        """The tail jumps of the function at ``start`` (and of its ``.cold`` parts): direct
        jumps to another function's first byte. Raises _GiveUp for a function gdb could not
        search: an indirect tail jump, a jump to code without DWARF, no symbol."""
        if start not in self._sites:
            self._sites.put(start, self._scan(start))
        found = self._sites[start]
        if found is None:
            raise _GiveUp
        return found

    def _scan(self, start: int) -> tuple[_Site, ...] | None:
        image = self.image(start)
        found = None if image is None else image.function(start)
        if image is None or found is None:
            return None
        parts = image.parts(start)
        jumps, frame = self._jumps(image, start, found[1], parts)
        sites: list[_Site] = []
        for end_pc, target in jumps:
            if target is None:
                return None  # an indirect jump: gdb cannot evaluate its target
            kind = self._kind(target, parts)
            if kind is TargetKind.OPAQUE or kind is TargetKind.INDIRECT:
                return None
            if kind is TargetKind.FUNCTION:
                sites.append(_Site(end_pc, target, frame))
        return tuple(sites)

    def _jumps(
        self, image: CodeImage, start: int, end: int, parts: list[int]
    ) -> tuple[list[tuple[int, int | None]], bool]:
        """The jumps of the function at ``start`` (``end``: where its symbol ends) and whether
        it can be a frame: not when its code is only a jump out of itself, then that jump."""
        lone = image.arch.lone_jump(image.code(start, end), start)
        if lone is not None:
            into = self._function(lone[1])
            if into is None or into[1] != start:
                # Nothing but the jump runs (gdb has no call site in it to make a frame from);
                # what follows the jump is not its code (arm64's memset: the MOPS variant that
                # boot-time patching enables on a CPU with FEAT_MOPS).
                return [lone], False
            # A first jump into itself (a static key's or an alternative's) passes over code
            # the function still has: 481 functions of Debian's arm64 7.2.13 begin so, 13 of
            # amd64 6.12 and 8 of riscv64 6.12 (their images, read for issue 35).
        jumps: list[tuple[int, int | None]] = []
        for part in parts:
            found = image.function(part)
            assert found is not None
            jumps += image.arch.branches(image.code(part, found[1]), part)
        return jumps, True

    def _kind(self, target: int, parts: list[int]) -> TargetKind | None:
        """What a jump to ``target`` is; None: no tail call (within the function, or not to a
        function's first byte)."""
        image = self.image(target)
        found = None if image is None else image.function(target)
        if image is None or found is None or found[0] != target:
            return None
        if image.owner(target) in parts or target in parts:
            return None
        return image.kind(found[2])


_FINDERS: Memo[tuple[CodeImage, ...], TailCallFinder] = Memo(64)


class _Search:
    """One depth-first search from a call's target to the callee's function, with gdb's
    intersection of the paths it finds."""

    def __init__(self, finder: TailCallFinder, callee: int) -> None:
        self.finder = finder
        self.callee = callee
        self.path: list[_Site] = []
        self.on_path: set[int] = set()
        self.entered = 0
        self.first: list[_Site] | None = None
        self.callers = self.callees = 0

    def run(self, target: int) -> Chain:
        self._visit(target)
        first = self.first
        if first is None:
            return Chain((), Outcome.NO_PATH)
        if self.callers == 0 and self.callees == 0:
            return Chain((), Outcome.AMBIGUOUS)
        length = len(first)
        if self.callers == length and self.callees == length:
            kept = first
        else:
            kept = first[: self.callers] + first[length - self.callees :]
        return Chain(tuple(site.pc for site in reversed(kept) if site.frame), Outcome.FOUND)

    def _visit(self, target: int) -> bool:
        """False: the candidates so far share nothing, the search is over (gdb's early
        return)."""
        if target == self.callee:
            return self._candidate()
        for site in self.finder.sites(target):
            if site.pc in self.on_path:
                continue
            self.entered += 1
            if self.entered > MAX_SITES:
                raise _GiveUp
            self.on_path.add(site.pc)
            self.path.append(site)
            if not self._visit(site.target):
                return False
            self.path.pop()
            self.on_path.discard(site.pc)
        return True

    def _candidate(self) -> bool:
        path = self.path
        if self.first is None:
            self.first = list(path)
            self.callers = self.callees = len(path)
            return True
        first, length = self.first, len(path)
        self.callers = _common(first, path, min(self.callers, length))
        self.callees = _common(first[::-1], path[::-1], min(self.callees, length))
        # Both 0 also when a direct path (length 0) competes with another: ambiguous.
        return self.callers > 0 or self.callees > 0


def _common(a: Sequence[_Site], b: Sequence[_Site], limit: int) -> int:
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit


def with_tail_calls(
    pcs: Sequence[int], exact: Sequence[bool], finder: TailCallFinder
) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[Chain | None, ...]]:
    """A walked stack (leaf first; ``exact[i]``: pcs[i] is where the CPU was, not a return
    address) with tail-call frames inserted between each callee and a caller that called;
    the chain found below each original frame (None where nothing was searched)."""
    out_pcs: list[int] = []
    out_exact: list[bool] = []
    chains: list[Chain | None] = []
    for i, pc in enumerate(pcs):
        out_pcs.append(pc)
        out_exact.append(exact[i])
        chain = None
        # A caller reached through a trap frame was interrupted: there is no call to read.
        if i + 1 < len(pcs) and not exact[i + 1]:
            chain = finder.between(pcs[i + 1], pc if exact[i] else pc - 1)
            out_pcs += chain.pcs
            out_exact += [False] * len(chain.pcs)
        chains.append(chain)
    return tuple(out_pcs), tuple(out_exact), tuple(chains)
