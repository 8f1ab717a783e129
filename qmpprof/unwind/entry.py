"""A kernel's exception entry and exit code, where its frame records do not tell the walk the
truth: the code a CPU runs on an exception before the kernel saved the interrupted state, and
the frame the kernel saves it in, which the walk crosses into the interrupted code.

A CPU that pushes nothing on an exception (aarch64) leaves the interrupted state in registers:
the pc in the exception link register (ELR_EL1, DWARF 33), the interrupted code's own x29, x30
and sp. Linux's entry code then saves them (``pt_regs``) and adds a frame record inside that
frame whose return address is the interrupted pc. The kernel describes it all (``EntryCode``:
its symbols and BTF, built by the guest OS); this step follows it:

- code entered from user mode (the vector table's user half, the user-mode handlers) or on its
  way back (``ret_to_user``): the kernel stack is this one frame, whole; once a handler saved
  the user's registers (x29 at the frame's record, zeroed: the kernel stack's end), the walk
  goes on in user code from them, its pc exact; before anything is saved (the table's user
  half, a handler's first instruction) the user's registers are the CPU's, its pc in the
  exception link register and its stack pointer in the user one (SP_EL0, ``user_sp``), both
  read for such samples only: the walk goes on in user code from them;
- the vector table's kernel half, at an entry point: the interrupted code's pc is the
  exception link register's (read for such samples only), the rest unchanged; elsewhere in the
  table the stack pointer is mid-adjustment: the walk stops (truncated, honestly);
- a kernel-mode handler: once its record is set (x29 at it; the interrupted pc in it, or
  zeroed: ``EntryCode.linked``), the interrupted registers are read from the saved frame, the
  pc exact (no return address: named as is, prologue analysis applies to it), from the
  exception link register until the handler stored it (``EntryCode.pc_unsaved``); before the
  record, they are still the CPU's, sp lowered by the frame's size.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.model import StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.steps import EXACT, NEW_STACK, Outcome, Regs, Via, word_reader

Span = tuple[int, int]  # [start, end) at link addresses
_AARCH32 = 1 << 4  # in a saved status, PSTATE.nRW: the exception came from 32-bit code
_EL1 = 1 << 2  # a status's exception level (bits 3..2): the kernel's


@dataclass(frozen=True, slots=True)
class SavedFrame:
    """Where an exception entry saves the interrupted registers (Linux's ``pt_regs``), in bytes
    from the frame's start: ``count`` registers from ``regs`` (DWARF 0..count-1), then the
    stack pointer, the pc and the status (whose bits 3..2 are the exception level it came
    from); the frame record the entry adds at ``record``, and the word saying what kind of
    record it is at ``kind`` (Linux's ``frame_record_meta.type``, from 6.13; None: no such word);
    ``size`` in all."""

    regs: int
    count: int
    sp: int
    pc: int
    status: int
    record: int
    size: int
    kind: int | None = None


@dataclass(frozen=True, slots=True)
class EntryCode:
    """A kernel's exception code at link addresses: ``user`` (entered from user mode or going
    back to it), ``vectors`` (the kernel half of the vector table) and its ``entries`` (the
    points an exception from the kernel lands on), ``saving`` (the handlers of exceptions
    from the kernel, which save ``frame``), ``restoring`` (the way back, which loads it again);
    ``link``: the DWARF number of the exception link register the guest OS reads, by the
    transport's name ``link_name``.
    ``unsaved``: where, entered from user mode, nothing of the user's is saved or changed yet
    (the table's user half, the user-mode handlers' first instructions); ``user_sp``: the
    number the guest OS gives the user stack pointer it reads for those (DWARF has none).
    ``linked``: the record a kernel-mode handler adds holds the interrupted code's fp and pc
    (the walk checks that pc against the saved one); else it is zeroed, the saved frame found
    from the record's address alone, its kind word ``record_kind`` where the frame has one
    (Linux's FRAME_META_TYPE_PT_REGS, read from the handlers' code). ``pc_unsaved``: where in a
    kernel-mode or 64-bit user handler the record is set but the saved frame holds no pc and
    status yet (the pc is the exception link register's)."""

    user: tuple[Span, ...]
    vectors: Span
    entries: tuple[int, ...]
    saving: tuple[Span, ...]
    restoring: tuple[Span, ...]
    frame: SavedFrame
    link: int
    unsaved: tuple[Span, ...] = ()
    user_sp: int | None = None
    linked: bool = True
    pc_unsaved: tuple[Span, ...] = ()
    record_kind: int | None = None
    link_name: str = ""  # the transport's names of the link register and the user one
    user_sp_name: str = ""

    def step(self, bias: int, arch: InstructionSet) -> EntryStep:
        return EntryStep(self, bias, arch)

    def holds_link(self, pc: int) -> bool:
        """Whether at link address ``pc`` the interrupted pc may be only in the exception
        link register: the vector table's kernel half, a kernel-mode handler's first part, a
        handler before it saved the pc."""
        low, high = self.vectors
        spans = (*self.saving, *self.pc_unsaved)
        return low <= pc < high or any(start <= pc < end for start, end in spans)

    def holds_user(self, pc: int) -> bool:
        """Whether at link address ``pc`` the user's pc and stack pointer are only in the
        exception link register and the user stack pointer (``unsaved``)."""
        return self.user_sp is not None and any(start <= pc < end for start, end in self.unsaved)


class _Spans:
    """Spans sorted by start, searched by address."""

    __slots__ = ("spans", "starts")

    def __init__(self, spans: Sequence[Span]) -> None:
        self.spans = sorted(spans)
        self.starts = [start for start, _ in self.spans]

    def __contains__(self, addr: int) -> bool:
        at = bisect_right(self.starts, addr) - 1
        return at >= 0 and addr < self.spans[at][1]


class EntryStep:
    """The walk through exception entry and exit code (``Via.ENTRY``)."""

    via = Via.ENTRY
    __slots__ = ("arch", "bias", "code", "pc_unsaved", "restoring", "saving", "unsaved", "user")

    def __init__(self, code: EntryCode, bias: int, arch: InstructionSet) -> None:
        self.code = code
        self.bias = bias
        self.arch = arch
        self.user, self.saving = _Spans(code.user), _Spans(code.saving)
        self.restoring = _Spans(code.restoring)
        self.unsaved = _Spans(code.unsaved)
        self.pc_unsaved = _Spans(code.pc_unsaved)

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        code, link = self.code, pc - self.bias
        if link in self.user:
            if interrupted and link in self.unsaved:
                return self._from_user(cur)
            return self._user(cur, interrupted, memory, interrupted and link in self.pc_unsaved)
        low, high = code.vectors
        if low <= link < high:
            if not interrupted:
                return None
            if link in code.entries:
                return self._in_registers(cur, cur[self.arch.sp])
            return StopReason.NO_CFI  # sp mid-adjustment: not modelled
        in_saving = link in self.saving
        if not in_saving and link not in self.restoring:
            return None
        arch, frame = self.arch, code.frame
        fp = cur.get(arch.fp, 0)
        if fp and (not interrupted or fp == (cur[arch.sp] + frame.record) & arch.mask):
            elr = None
            if interrupted and link in self.pc_unsaved:
                elr = cur.get(code.link)
                if elr is None:
                    return StopReason.NO_CFI  # not read (a transport without system registers)
            return self._saved((fp - frame.record) & arch.mask, fp, memory, elr)
        if in_saving and interrupted:  # no record yet: x29, x30 still the interrupted code's
            return self._in_registers(cur, (cur[arch.sp] + frame.size) & arch.mask)
        if interrupted:
            return StopReason.NO_CFI  # on the way back, the record loaded again: not modelled
        return None

    def _user(self, cur: Regs, interrupted: bool, memory: PageCache, pc_unsaved: bool) -> Outcome:
        """Nothing of the kernel's below this frame: the user code's registers where the entry
        saved them (its record set and zeroed; the pc in the exception link register where
        ``pc_unsaved``), else the stack's end."""
        arch, frame = self.arch, self.code.frame
        fp = cur.get(arch.fp, 0)
        if not fp or (interrupted and fp != (cur[arch.sp] + frame.record) & arch.mask):
            return StopReason.END  # not saved yet (or restored): the registers are live
        word, mask = arch.address_size, arch.mask
        read = word_reader(memory, arch)
        base = (fp - frame.record) & mask
        record = [read(fp), read((fp + word) & mask)]
        values = [read((base + frame.regs + i * word) & mask) for i in range(frame.count)]
        sp, pc, status = (read((base + off) & mask) for off in (frame.sp, frame.pc, frame.status))
        if pc_unsaved:  # a 64-bit user handler's: from 64-bit user code
            pc, status = cur.get(self.code.link, 0), 0
        if None in record or None in values or sp is None or pc is None or status is None:
            return StopReason.READ_FAILED
        if any(record) or (status >> 2) & 3 or status & _AARCH32 or not pc:
            return StopReason.END  # not a 64-bit user frame's end
        new: Regs = {i: v for i, v in enumerate(values) if v is not None}
        new[arch.pc], new[arch.sp] = pc, sp
        return new, EXACT | NEW_STACK

    def _from_user(self, cur: Regs) -> Outcome:
        """The user code's registers, still the CPU's: its pc in the exception link register,
        its stack pointer in the user one; the kernel stack's end when they were not read."""
        code = self.code
        pc, sp = cur.get(code.link), None if code.user_sp is None else cur.get(code.user_sp)
        if not pc or sp is None:
            return StopReason.END  # not read (a transport without system registers)
        new = {reg: value for reg, value in cur.items() if reg not in (code.link, code.user_sp)}
        new[self.arch.pc], new[self.arch.sp] = pc, sp
        return new, EXACT | NEW_STACK

    def _in_registers(self, cur: Regs, sp: int) -> Outcome:
        """The interrupted code's registers, its pc in the exception link register."""
        elr = cur.get(self.code.link)
        if elr is None:
            return StopReason.NO_CFI  # not read (a transport without system registers)
        new = dict(cur)
        del new[self.code.link]
        new[self.arch.pc], new[self.arch.sp] = elr, sp
        return new, EXACT

    def _saved(self, base: int, fp: int, memory: PageCache, elr: int | None = None) -> Outcome:
        """The interrupted registers from the frame at ``base``, whose record is at ``fp``; the
        pc ``elr`` where the frame holds none yet (a kernel-mode handler's: from the kernel)."""
        arch, frame = self.arch, self.code.frame
        word, mask = arch.address_size, arch.mask
        read = word_reader(memory, arch)
        values = [read((base + frame.regs + i * word) & mask) for i in range(frame.count)]
        sp, pc, status = (read((base + off) & mask) for off in (frame.sp, frame.pc, frame.status))
        if elr is not None:
            pc, status = elr, _EL1
        record = [read(fp), read((fp + word) & mask)]
        kind = self.code.record_kind
        if kind is not None and frame.kind is not None:
            # The zeroed record's kind word, which the kernel's own unwinder checks: zero too
            # when it is the handlers'.
            found = read((base + frame.kind) & mask)
            record.append(None if found is None else found ^ kind)
        if sp is None or pc is None or status is None or None in record or None in values:
            return StopReason.READ_FAILED
        if record[1] != pc if self.code.linked else any(record):
            return None  # no saved frame there: frame records then
        if (status >> 2) & 3 == 0:
            return StopReason.END  # it came from user mode: nothing of the kernel's below
        new: Regs = {i: v for i, v in enumerate(values) if v is not None}
        new[arch.pc], new[arch.sp] = pc, sp
        return new, EXACT
