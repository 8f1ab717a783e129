"""arm64 Linux's exception entry and exit code as the walk needs it (``unwind.entry.EntryCode``),
read from the kernel itself: the code of its vector table and handlers, its function table
(kallsyms) and the layout of ``pt_regs`` (BTF). No handler is known by its name.

``arch/arm64/kernel/entry.S`` (5.10 to 7.2 at least): ``vectors`` is the 2 KiB table of 16
entries of 0x80 bytes, by where the exception came from: the kernel with SP_EL0 (unused by
Linux), the kernel with SP_ELx (+0x200: sync, irq, fiq, error), 64-bit user code (+0x400),
32-bit user code (+0x600). An entry lowers sp by ``sizeof(pt_regs)``, checks it for an overflow
and branches to its handler: the entry's first ``b`` out of it (a user entry's first
instruction branches inside it, past the trampoline's cleanup). The handler's ``kernel_entry``
saves x0..x30, sp, ELR (the pc) and SPSR into ``pt_regs``, then stores the frame record
``pt_regs.stackframe`` and points x29 at it (``add x29, sp, #offset``: every handler has it,
at BTF's offset, or the code is not the one this module knows). What the kernel-mode handlers
store there (``stp`` to that offset just before) is read too: to 6.12 the record {x29, ELR}
(``stp x29, x22``; zeroed from user mode: the final record); from 6.13 a zeroed record in all
of them (``stp xzr, xzr``), then the record's kind word (``mov x0, #kind; str x0`` to
``frame_record_meta.type`` in BTF: FRAME_META_TYPE_PT_REGS from the kernel, FINAL from user
mode), ``pt_regs`` then found from the record's address and checked by its kind, as the
kernel's own unwinder does (``EntryCode.linked``, ``record_kind``). Any other store there is
not the code this module knows. The pc and status go into ``pt_regs`` after x29 is set (``stp
x22, x23``, 5.10 to 7.2): until that store the interrupted pc is only in ELR_EL1
(``EntryCode.pc_unsaved``). Then the handlers come in two shapes:

- from 5.12 (``el1h_64_irq``, ``el0t_64_sync`` and kin): a call, then a ``b`` to the way back
  (``ret_to_kernel``, ``ret_to_user``), whose ``kernel_exit`` loads it all back and ``eret``s;
- 5.10 (``el1_irq``, ``el0_sync`` and kin): a kernel-mode handler returns by itself, its
  ``kernel_exit`` inline up to its own ``eret``; from its record on it is the way back
  (``el1_irq`` also moves sp to the IRQ stack and back around the interrupt's handler: the
  record is then not at sp, and such a sample stops). A user-mode handler branches to
  ``ret_to_user``, whose ``kernel_exit`` is in the next function of kallsyms
  (``finish_ret_to_user``, a plain label): the way back runs through the first function with
  an ``eret``.

From user mode, until ``kernel_entry``'s stores are done, the user's x29 and x30 are the
CPU's, its pc in ELR_EL1 and its stack pointer in SP_EL0 (which then takes the task): in the
table's 64-bit user entries (but at an entry's second instruction, where a trampoline entered
x30 holds its return until the entry takes the user's back from TPIDRRO_EL0) and at their
handlers' first instruction.

A kernel without a vector table (x86_64's, unwound by ORC) or whose code is not this has none.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from qmpprof.arch.aarch64code import (
    branch_target,
    is_eret,
    is_hint,
    is_jump,
    moved_imm,
    pair_stored_at,
    sets_fp,
    stored_at,
)
from qmpprof.elf.symbols import SymbolTable
from qmpprof.linux.btf import BtfError
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.unwind.entry import EntryCode, SavedFrame, Span

ELR = 33  # ELR_mode in the DWARF for the Arm 64-bit Architecture
SP_EL0 = 0x1000  # the user stack pointer: no DWARF number, one of the walk's own
_TRAMPOLINE_X30 = 4  # an entry's instruction at which x30 is a trampoline's return
_KERNEL_HALF = range(0x200, 0x400, 0x80)  # the vector table's entries from the kernel, SP_ELx
_USER_HALF = range(0x400, 0x800, 0x80)  # 64-bit user code's four entries, then 32-bit's
_REACH = 32  # functions followed from the handlers: more is not the code this module knows
_XZR, _FP = 31, 29


def entry_code(kernel: LinuxKernel) -> EntryCode | str | None:
    """The kernel's exception code; None without a vector table (no such code to describe),
    or one line saying why its BTF or code does not describe it."""
    vectors = kernel.symbols.address_of("vectors")
    if vectors is None:
        return None
    frame = _saved_frame(kernel)
    if frame is None:
        return "no pt_regs in this kernel's BTF: kernel stacks end at an exception's entry"
    code = Code(kernel.image.text_bytes, kernel.image.text_addr, kernel.functions)
    found = exception_code(code, vectors, frame)
    if isinstance(found, str):
        return (
            f"this kernel's exception entry code is in no shape qmpprof knows ({found}):"
            " kernel stacks end at an exception's entry"
        )
    return found


def entry_shapes(kernel: LinuxKernel) -> list[tuple[int, bool, str]]:
    """Each entry of the vector table's kernel and 64/32-bit user halves: its offset, whether
    its handler is of a shape this module knows, and that shape in a few words or why it is
    none it knows; none without a vector table or ``pt_regs`` in BTF."""
    vectors, frame = kernel.symbols.address_of("vectors"), _saved_frame(kernel)
    if vectors is None or frame is None:
        return []
    code = Code(kernel.image.text_bytes, kernel.image.text_addr, kernel.functions)
    shapes = []
    for off in (*_KERNEL_HALF, *_USER_HALF):
        handler = code.handler(vectors + off, frame)
        if isinstance(handler, str):
            shapes.append((off, False, handler))
        else:
            shapes.append((off, handler.linked is not None, handler.shape()))
    return shapes


def exception_code(code: Code, vectors: int, frame: SavedFrame) -> EntryCode | str:
    """The exception code ``code`` holds, its vector table at ``vectors``, ``frame`` its
    ``pt_regs``; else what in its code is not the one this module knows."""
    handlers = []
    for off in (*_KERNEL_HALF, *_USER_HALF):
        handler = code.handler(vectors + off, frame)
        if isinstance(handler, str):
            return f"vectors+{off:#x}: {handler}"
        handlers.append(handler)
    from_kernel, from_user = handlers[: len(_KERNEL_HALF)], handlers[len(_KERNEL_HALF) :]
    user = code.reach([handler.span[0] for handler in from_user])
    back = code.reach([to for handler in from_kernel for to in code.branches_out(*handler.span)])
    kernel = {handler.span for handler in from_kernel}
    if user is None or back is None or user & (kernel | back):
        return "its handlers lead out of the entry code, or into the same code from both modes"
    records = {handler.linked for handler in from_kernel}
    kinds = {handler.kind for handler in from_kernel}
    if None in records or len(records) != 1:
        return "its kernel-mode handlers' records are not of one shape it knows"
    zeroed = records == {False}
    if zeroed and frame.kind is not None and (None in kinds or len(kinds) != 1):
        return "its kernel-mode handlers' zeroed records are not of one kind it reads"
    user.add((vectors + _USER_HALF.start, vectors + _USER_HALF.stop))
    saving, restoring = set(), back
    # Where the record is set and the pc not yet saved: in the kernel-mode and 64-bit user
    # handlers (a 32-bit one's pc and status are not the walk's to guess).
    saves = [*from_kernel, *from_user[: len(_USER_HALF) // 2]]
    pc_unsaved = {(h.record, h.pc_saved) for h in saves if h.pc_saved > h.record}
    for handler in from_kernel:
        start, end = handler.span
        if handler.returns:  # 5.10: the way back once pt_regs is whole
            saving.add((start, handler.pc_saved))
            restoring.add((handler.pc_saved, end))
        else:  # from 5.12: the way back is another function
            saving.add(handler.span)
    # The user's registers still the CPU's: the 64-bit user entries and their handlers' first
    # instruction.
    user_64 = _USER_HALF[:4]
    unsaved = [(h.span[0], h.span[0] + 4) for h in from_user[: len(user_64)]]
    for entry in (vectors + off for off in user_64):
        unsaved += [(entry, entry + _TRAMPOLINE_X30), (entry + 8, entry + user_64.step)]
    low, high = vectors + _KERNEL_HALF.start, vectors + _KERNEL_HALF.stop
    return EntryCode(
        user=tuple(sorted(user)),
        vectors=(low, high),
        entries=tuple(range(low, high, _KERNEL_HALF.step)),
        saving=tuple(sorted(saving)),
        restoring=tuple(sorted(restoring)),
        frame=frame,
        link=ELR,
        unsaved=tuple(sorted(unsaved)),
        user_sp=SP_EL0,
        linked=not zeroed,
        pc_unsaved=tuple(sorted(pc_unsaved)),
        record_kind=kinds.pop() if zeroed and frame.kind is not None else None,
        link_name="ELR_EL1",  # as QEMU's gdbstub names them
        user_sp_name="SP_EL0",
    )


@dataclass(frozen=True, slots=True)
class _Handler:
    """A handler's function (``span``), where its frame record is set (``record``: just after
    ``add x29, sp, #...``) and where ``pt_regs`` holds the pc (``pc_saved``: after the first
    store to it from the record on; the record's address when there is none), whether it
    ``eret``s itself (``returns``), what it stores in the record (``linked``: x29 and a
    register, True; zeros, False; anything else, None) and in its kind word (``kind``: the
    value moved there; None without one)."""

    span: Span
    record: int
    pc_saved: int
    returns: bool
    linked: bool | None
    kind: int | None

    def shape(self) -> str:
        """The handler's shape in a few words, as check-kernels reports it."""
        stored = {True: "record {x29, pc}", False: "record zeroed", None: "record unknown"}
        kind = "" if self.kind is None else f" (kind {self.kind})"
        pc = ", pc saved after it" if self.pc_saved > self.record else ""
        way_back = "erets itself" if self.returns else "returns through a branch"
        return f"{stored[self.linked]}{kind}{pc}, {way_back}"


def _linked(stored: tuple[int, int] | None) -> bool | None:
    """What a handler's ``stp`` of registers ``stored`` into its record makes of it: True for
    {x29, the pc}, False for zeros, None for any other (or no) store."""
    if stored == (_XZR, _XZR):
        return False
    return True if stored is not None and stored[0] == _FP and stored[1] != _XZR else None


def _kind_word(words: list[tuple[int, int]], offset: int) -> int | None:
    """The value the last ``str xn, [sp, #offset]`` of ``words`` (address, instruction) stores,
    put in xn by the last ``mov xn, #value`` before it; None without both."""
    for at in reversed(range(len(words))):
        source = stored_at(words[at][1], offset)
        if source is None:
            continue
        moves = (moved_imm(insn) for _, insn in reversed(words[:at]))
        return next((move[1] for move in moves if move is not None and move[0] == source), None)
    return None


def _saved_frame(kernel: LinuxKernel) -> SavedFrame | None:
    """``pt_regs`` as BTF lays it out; None without BTF or with another layout. From 6.13 its
    record is a ``struct frame_record_meta``, whose kind word the frame's ``kind`` is."""
    btf = kernel.btf
    if btf is None:
        return None
    try:
        kind: int | None = btf.offset_of("pt_regs.stackframe.type")
    except (KeyError, BtfError):
        kind = None  # to 6.12: u64 stackframe[2], the record alone
    try:
        return SavedFrame(
            regs=btf.offset_of("pt_regs.regs"),
            count=31,
            sp=btf.offset_of("pt_regs.sp"),
            pc=btf.offset_of("pt_regs.pc"),
            status=btf.offset_of("pt_regs.pstate"),
            record=btf.offset_of("pt_regs.stackframe"),
            size=btf.size_of(btf.struct("pt_regs").id),
            kind=kind,
        )
    except (KeyError, BtfError):
        return None


class Code:
    """A kernel's code (``text`` at link address ``text_addr``), read word by word, and its
    functions' extents."""

    __slots__ = ("ends", "starts", "text", "text_addr")

    def __init__(self, text: bytes, text_addr: int, functions: SymbolTable) -> None:
        self.text, self.text_addr = text, text_addr
        self.starts = functions.starts
        self.ends = [end for _, end, _ in functions.items()]

    def words(self, start: int, end: int) -> list[tuple[int, int]]:
        """(address, instruction) from ``start`` to ``end``; none outside the text."""
        at = start - self.text_addr
        if at < 0 or end - self.text_addr > len(self.text):
            return []
        data = self.text[at : end - self.text_addr]
        words = range(0, len(data) - 3, 4)
        return [(start + i, int.from_bytes(data[i : i + 4], "little")) for i in words]

    def handler(self, entry: int, frame: SavedFrame) -> _Handler | str:
        """The handler the vector entry at ``entry`` branches to (its first ``b`` out of the
        entry), read; else why not: no branch, no function there, or no record at BTF's
        offset."""
        target = next(iter(self.branches_out(entry, entry + _KERNEL_HALF.step)), None)
        if target is None:
            return "no branch out of the entry"
        at = self.function(target)
        if at is None:
            return f"a branch to {target:#x}, no function's start"
        words = self.words(target, self.ends[at])
        record = next((pc + 4 for pc, insn in words if sets_fp(insn) == frame.record), None)
        if record is None:
            return f"no add x29, sp, #{frame.record:#x} (pt_regs' record) in its handler"
        stores = [pair_stored_at(insn, frame.record) for pc, insn in words if pc < record]
        stored = next((pair for pair in reversed(stores) if pair is not None), None)
        pc_saved = next(
            (pc + 4 for pc, insn in words if pc >= record and pair_stored_at(insn, frame.pc)),
            record,
        )
        returns = any(is_eret(insn) for _, insn in words)
        before = [(pc, insn) for pc, insn in words if pc < record]
        kind = None if frame.kind is None else _kind_word(before, frame.kind)
        span = (target, self.ends[at])
        return _Handler(span, record, pc_saved, returns, _linked(stored), kind)

    def reach(self, starts: list[int]) -> set[Span] | None:
        """The functions run from those at ``starts``: through their ``b``s out of them and
        into the next function where one neither returns (``eret``) nor ends in a jump; None:
        a branch to no function's start, or more than ``_REACH`` functions."""
        todo, seen = [self.function(start) for start in starts], set[int]()
        while todo:
            at = todo.pop()
            if at is None or len(seen) > _REACH:
                return None
            if at in seen:
                continue
            seen.add(at)
            words = self.words(self.starts[at], self.ends[at])
            todo += [self.function(to) for to in self.branches_out(self.starts[at], self.ends[at])]
            body = [insn for _, insn in words if not is_hint(insn)]
            if body and not is_jump(body[-1]) and not any(map(is_eret, body)):
                todo.append(at + 1 if at + 1 < len(self.starts) else None)
        return {(self.starts[at], self.ends[at]) for at in seen}

    def branches_out(self, start: int, end: int) -> list[int]:
        """The targets of the ``b``s from [start, end) out of it, in order, each once."""
        targets = [branch_target(insn, at) for at, insn in self.words(start, end)]
        out = [t for t in targets if t is not None and not start <= t < end]
        return list(dict.fromkeys(out))

    def function(self, start: int) -> int | None:
        """The index of the function starting at ``start``."""
        at = bisect_left(self.starts, start)
        return at if at < len(self.starts) and self.starts[at] == start else None
