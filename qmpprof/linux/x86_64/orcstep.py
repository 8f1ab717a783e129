"""The unwinding step of a Linux x86_64 kernel's ORC tables (``orctables`` reads them), handed
to ``unwind.order.steps_for`` by whoever builds the kernel's and its modules' ``Module``.

``OrcStep`` follows the entries as the kernel's ``unwind_orc.c`` does: the caller's stack pointer
from SP, BP, an indirect slot or a register saved in a ``pt_regs``; its pc from the return address
below it (CALL), from a full ``pt_regs`` (REGS, which also hands over every register, those of
user mode under a system call or an interrupt) or from an iret frame (REGS_PARTIAL).

Two rules more than the kernel's, for code ORC leaves UNDEFINED (the retpoline and return
thunks), where the word at SP is a return address (``functions`` says where functions start and
what they are called, at link addresses):

- when the CPU stands on a function's first byte, its entry: the call just pushed the return
  address and nothing else. TCG stops at block starts, so samples land there (~1 % of kernel
  ones);
- anywhere in a retpoline thunk (``__x86_indirect_thunk_<reg>``, ``__pi_``-prefixed from 6.16
  on: ``call 1f; int3; 1: mov
  %reg, (%rsp); ret``): after its internal call, at the ``mov`` (a block start too), SP holds
  that call's return address (thunk + 5); the frame returning there is back at the thunk's
  entry, the caller's return address at SP. gdb shows both frames.

Before 6.4 the thunks' hint (UNWIND_HINT_EMPTY) reads as END_OF_STACK, as at true ends
(``entry_SYSCALL_64``, ``ret_from_fork``): there the rules hold only within ``thunks``, the link
addresses ``__indirect_thunk_start`` .. ``__indirect_thunk_end`` of such kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.symbols import SymbolTable
from qmpprof.linux.x86_64.orctables import (
    IRET_FRAME,
    RETPOLINE_THUNK,
    X86_64_PT_REGS,
    OrcEntry,
    OrcTable,
    OrcType,
    PtRegs,
    unaliased,
)
from qmpprof.memo import Memo
from qmpprof.model import StopReason
from qmpprof.pagecache import PageCache
from qmpprof.unwind.steps import NEW_STACK, Outcome, Regs, Via


@dataclass(frozen=True, slots=True, eq=False)
class OrcCode:
    """What a piece of kernel code (the image, a module) offers an ``OrcStep``: its table, and
    for the thunks' rule where functions start and where the thunks are (link addresses); how
    its kernel lays out a ``pt_regs``."""

    table: OrcTable
    functions: SymbolTable | None = None
    thunks: tuple[int, int] | None = None
    pt_regs: PtRegs = X86_64_PT_REGS


class OrcStep:
    """The caller of a frame by the ORC entry of its pc."""

    via = Via.ORC
    __slots__ = ("_entries", "arch", "bias", "code")

    def __init__(self, code: OrcCode, bias: int, arch: InstructionSet) -> None:
        self.code = code
        self.bias = bias  # runtime address - link address (the KASLR slide)
        self.arch = arch
        # runtime pc -> its entry (None: outside the table; NO_CFI: undecodable)
        self._entries: Memo[int, OrcEntry | StopReason | None] = Memo()

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        arch = self.arch
        link_pc = (pc - self.bias) & arch.mask
        try:
            entry = self._entries[pc]
        except KeyError:
            entry = self._entries.put(pc, self._entry(link_pc))
        if entry is None or isinstance(entry, StopReason):
            return entry
        kind = entry.type
        if kind is OrcType.END_OF_STACK:
            if self._in_thunks(link_pc) and self._return_at_sp(link_pc, interrupted):
                return self._return_address_at_sp(cur, memory)
            return StopReason.END
        if kind is OrcType.UNDEFINED:
            if self._return_at_sp(link_pc, interrupted):
                return self._return_address_at_sp(cur, memory)
            return StopReason.NO_CFI  # the kernel gives up here too: its code is known, unwalkable
        sp = self._caller_sp(entry, cur, memory)
        if isinstance(sp, StopReason):
            return sp
        if kind is OrcType.CALL:
            ra = memory.read_u64((sp - 8) & arch.mask)
            if ra is None:
                return StopReason.READ_FAILED
            # Only sp and bp are known in a caller: ORC tracks no other register.
            new: Regs = {arch.pc: ra, arch.sp: sp, arch.fp: cur.get(arch.fp, 0)}
            signal = entry.signal
        else:
            found = self._regs_frame(kind, sp, cur, memory)
            if isinstance(found, StopReason):
                return found
            new, signal = found
            signal = signal or entry.signal
        bp = self._caller_bp(entry, sp, cur, memory)
        if isinstance(bp, StopReason):
            return bp
        if bp is not None:
            new[arch.fp] = bp
        # A stack pointer saved when the kernel switched to an IRQ stack: "*sp + offset" (5.12
        # on: call_on_stack keeps it at the IRQ stack's top) or "bp + offset" (5.10's
        # asm_call_irq_on_stack kept it in bp; elsewhere bp-based frames realign their own
        # stack). The interrupted stack may lie anywhere, below this one too: the kernel's
        # unwinder holds the stack pointer to growing only within one stack.
        regs = self.code.table.regs
        saved = entry.sp_reg in (regs.sp_indirect, regs.bp)
        return new, signal | NEW_STACK if saved else signal

    def _entry(self, link_pc: int) -> OrcEntry | StopReason | None:
        try:
            return self.code.table.lookup(link_pc)
        except ValueError:
            return StopReason.NO_CFI

    def _in_thunks(self, link_pc: int) -> bool:
        thunks = self.code.thunks
        return thunks is not None and thunks[0] <= link_pc < thunks[1]

    def _return_at_sp(self, link_pc: int, interrupted: bool) -> bool:
        """Unwound code where the word at SP is a return address (the module's docstring)."""
        functions = self.code.functions
        found = None if functions is None else functions.lookup(link_pc)
        if found is None:
            return False
        return (interrupted and found[1] == 0) or unaliased(found[0]).startswith(RETPOLINE_THUNK)

    def _return_address_at_sp(self, cur: Regs, memory: PageCache) -> Outcome:
        arch = self.arch
        sp = cur[arch.sp]
        ra = memory.read_u64(sp)
        if ra is None:
            return StopReason.READ_FAILED
        return {arch.pc: ra, arch.sp: (sp + 8) & arch.mask, arch.fp: cur.get(arch.fp, 0)}, False

    def _caller_sp(self, entry: OrcEntry, cur: Regs, memory: PageCache) -> int | StopReason:
        """The address the entry's sp rule gives: the caller's sp, or the pt_regs/iret frame's."""
        reg, offset, mask = entry.sp_reg, entry.sp_offset, self.arch.mask
        sp, bp = cur[self.arch.sp], cur.get(self.arch.fp, 0)
        regs = self.code.table.regs
        if reg == regs.sp:
            return (sp + offset) & mask
        if reg == regs.bp:
            return (bp + offset) & mask
        if reg == regs.sp_indirect:  # since 5.12 "*sp + offset"; unused by earlier kernels
            slot = memory.read_u64(sp)
            return StopReason.READ_FAILED if slot is None else (slot + offset) & mask
        if reg == regs.bp_indirect:
            slot = memory.read_u64((bp + offset) & mask)
            return StopReason.READ_FAILED if slot is None else slot
        dwarf = regs.dwarf(reg)
        value = None if dwarf is None else cur.get(dwarf)
        # A register base is only known where a pt_regs (or the CPU) gave it: the kernel's rule.
        return StopReason.NO_CFI if value is None else value

    def _regs_frame(
        self, kind: OrcType, addr: int, cur: Regs, memory: PageCache
    ) -> tuple[Regs, bool] | StopReason:
        """The interrupted code's registers from a pt_regs (REGS) or an iret frame
        (REGS_PARTIAL) at ``addr``, and whether they are user mode's."""
        arch = self.arch
        if kind is OrcType.REGS:
            layout = self.code.pt_regs
            data = memory.read(addr, layout.size)
            if data is None:
                return StopReason.READ_FAILED
            new = {dwarf: _u64(data, offset) for dwarf, offset in layout.regs}
            new[arch.pc], new[arch.sp] = _u64(data, layout.ip), _u64(data, layout.sp)
            return new, bool(_u64(data, layout.cs) & 3)
        data = memory.read(addr, IRET_FRAME.size)
        if data is None:
            return StopReason.READ_FAILED
        ip, cs, _flags, sp, _ss = IRET_FRAME.unpack(data)
        # The other registers are the ones the entry code has not touched yet: those of ``cur``.
        partial = dict(cur)
        partial[arch.pc], partial[arch.sp] = ip, sp
        return partial, bool(cs & 3)

    def _caller_bp(
        self, entry: OrcEntry, sp: int, cur: Regs, memory: PageCache
    ) -> int | StopReason | None:
        """The caller's bp by the entry's bp rule; None: undefined, so the bp is the frame's own
        or the one the pt_regs held."""
        reg, mask, regs = entry.bp_reg, self.arch.mask, self.code.table.regs
        if reg == regs.undefined:
            return None
        if reg == regs.prev_sp:
            addr = (sp + entry.bp_offset) & mask
        elif reg == regs.bp:
            addr = (cur.get(self.arch.fp, 0) + entry.bp_offset) & mask
        else:
            return StopReason.NO_CFI
        bp = memory.read_u64(addr)
        return StopReason.READ_FAILED if bp is None else bp


def _u64(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset : offset + 8], "little")
