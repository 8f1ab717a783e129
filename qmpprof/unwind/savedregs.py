"""An exception entry that saves the interrupted registers in a frame at its own stack pointer
and calls its handlers from there, adding no frame record (riscv64 Linux's ``handle_exception``
and ``ret_from_exception``): the walk crosses it from that frame into the interrupted code.

The kernel describes it (``SavedRegsEntry``: its symbols, BTF and code, read by the guest OS):

- ``live``: where nothing is changed yet but the pc, which is in the exception link register
  (riscv64's ``sepc``, read for such samples only): the interrupted code's registers are the
  CPU's, its pc the link register's;
- ``saved``: where the frame is whole at the stack pointer (the handlers' calls, and the way back
  up to the load of the interrupted stack pointer): the interrupted registers are read from it,
  the pc exact; its status says whether the exception came from the kernel or from user mode,
  where the walk goes on in user code (the kernel stack ends there);
- anywhere else in the entry the stack pointer or the frame is half made: the walk stops there,
  truncated, rather than read a frame not there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.model import StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.steps import EXACT, NEW_STACK, Outcome, Regs, Via, word_reader

Span = tuple[int, int]  # [start, end) at link addresses


@dataclass(frozen=True, slots=True)
class SavedRegsEntry:
    """The entry's code at link addresses (``entry``: all of it) and its frame: general
    register n (DWARF n, 1 <= n < ``count``) at ``regs + n * word`` bytes from the frame's
    start, the interrupted pc at ``pc``, the status at ``status``, whose ``from_kernel`` bits
    are set for an exception taken in the kernel. ``link``: the DWARF number the exception link
    register's value is put at, ``link_name`` the transport's name for it."""

    entry: tuple[Span, ...]
    live: tuple[Span, ...]
    saved: tuple[Span, ...]
    regs: int
    count: int
    pc: int
    status: int
    from_kernel: int
    link: int
    link_name: str
    user_sp: int | None = None  # no user stack pointer apart from the general registers
    user_sp_name: str = ""

    def holds_link(self, pc: int) -> bool:
        """Whether at link address ``pc`` the interrupted pc is only in the link register."""
        return _within(self.live, pc)

    def holds_user(self, pc: int) -> bool:
        return False  # the user's stack pointer is a general register until it is saved

    def step(self, bias: int, arch: InstructionSet) -> SavedRegsStep:
        return SavedRegsStep(self, bias, arch)


class SavedRegsStep:
    """The walk through a ``SavedRegsEntry`` (``Via.ENTRY``)."""

    via = Via.ENTRY
    __slots__ = ("arch", "bias", "code")

    def __init__(self, code: SavedRegsEntry, bias: int, arch: InstructionSet) -> None:
        self.code = code
        self.bias = bias
        self.arch = arch

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        code, link = self.code, pc - self.bias
        if not _within(code.entry, link):
            return None
        if _within(code.saved, link):
            return self._saved(cur[self.arch.sp], memory)
        if interrupted and _within(code.live, link):
            new = dict(cur)
            elr = new.pop(code.link, None)
            if elr is None:
                return StopReason.NO_CFI  # not read (a transport without system registers)
            new[self.arch.pc] = elr
            return new, EXACT
        return StopReason.NO_CFI  # the stack pointer or the frame half made: not modelled

    def _saved(self, base: int, memory: PageCache) -> Outcome:
        arch, code = self.arch, self.code
        word, mask = arch.address_size, arch.mask
        read = word_reader(memory, arch)
        values = {n: read((base + code.regs + n * word) & mask) for n in range(1, code.count)}
        pc, status = read((base + code.pc) & mask), read((base + code.status) & mask)
        if pc is None or status is None or None in values.values():
            return StopReason.READ_FAILED
        new: Regs = {n: v for n, v in values.items() if v is not None}
        new[arch.pc] = pc
        if status & code.from_kernel:
            return new, EXACT
        return new, EXACT | NEW_STACK  # from user mode: the user's stack


def _within(spans: Sequence[Span], addr: int) -> bool:
    return any(start <= addr < end for start, end in spans)
