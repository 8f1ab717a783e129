"""ORC, the Linux x86_64 kernel's own unwind tables, and the unwinding step that follows them.

A kernel built with ``CONFIG_UNWINDER_ORC`` (the default since 4.14, every distribution kernel)
carries two parallel arrays: ``.orc_unwind_ip``, one s32 per entry holding the entry's code
address relative to the s32 itself, sorted; and ``.orc_unwind``, one 6-byte entry each: sp_offset
(s16), bp_offset (s16) and a u16 bitfield. The bitfield changed in 6.4: before it, ``sp_reg:4
bp_reg:4 type:2 end:1`` with types CALL, REGS, REGS_PARTIAL and "undefined" written as sp_reg
UNDEFINED (the end of the stack when ``end`` is set); from 6.4, ``sp_reg:4 bp_reg:4 type:3
signal:1`` with explicit UNDEFINED and END_OF_STACK types. Both decode into one ``OrcEntry`` in
the 6.4 numbering. The layout is decided from the entries themselves (``detect_layout``), so a
backport that changed the layout of an older version is read right; the kernel's version string
breaks a tie. A kernel module's tables, read out of guest memory, use the layout of its kernel.

``OrcStep`` follows the entries as the kernel's ``unwind_orc.c`` does: the caller's stack pointer
from SP, BP, an indirect slot or a register saved in a ``pt_regs``; its pc from the return address
below it (CALL), from a full ``pt_regs`` (REGS, which also hands over every register, those of
user mode under a system call or an interrupt) or from an iret frame (REGS_PARTIAL).
"""

from __future__ import annotations

import enum
import re
import struct
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from operator import add, le

from qmpprof.elf.image import ElfImage
from qmpprof.elf.symbols import SymbolTable
from qmpprof.memo import Memo
from qmpprof.model import RBP, RIP, RSP, StopReason
from qmpprof.pages import PageCache
from qmpprof.unwind.steps import NEW_STACK, Outcome, Regs, Via

MASK64 = (1 << 64) - 1
ENTRY_SIZE = 6
_ENTRY = struct.Struct("<hhH")

# struct pt_regs on x86_64: 21 u64, in this order; the DWARF number of each general register.
PT_REGS = struct.Struct("<21Q")
PT_REGS_DWARF = (15, 14, 13, 12, RBP, 3, 11, 10, 9, 8, 0, 2, 1, 4, 5)  # r15 .. di
PT_REGS_IP, PT_REGS_CS, PT_REGS_SP = 16, 17, 19  # indexes of ip, cs and sp
IRET_FRAME = struct.Struct("<5Q")  # ip, cs, flags, sp, ss: the tail of pt_regs


class OrcReg(enum.IntEnum):
    """The base registers of an entry's sp and bp rules (``ORC_REG_*``)."""

    UNDEFINED = 0
    PREV_SP = 1
    DX = 2
    DI = 3
    BP = 4
    SP = 5
    R10 = 6
    R13 = 7
    BP_INDIRECT = 8
    SP_INDIRECT = 9


class OrcType(enum.IntEnum):
    """What an entry says the frame is, in the numbering of 6.4 and later."""

    UNDEFINED = 0  # no unwind information: the walk is lost here
    END_OF_STACK = 1  # the outermost frame (a kernel thread's, or entry code's top)
    CALL = 2  # a normal frame: the return address sits just below the caller's sp
    REGS = 3  # a full pt_regs at sp: an interrupt, exception or system call frame
    REGS_PARTIAL = 4  # only the hardware's iret frame at sp


class OrcLayout(enum.Enum):
    """How the u16 bitfield of an entry is laid out."""

    LEGACY = "legacy"  # up to 6.3: sp_reg:4 bp_reg:4 type:2 (call, regs, regs-partial) end:1
    SIGNAL = "signal"  # 6.4 on: sp_reg:4 bp_reg:4 type:3 signal:1


# Legacy type numbers -> the 6.4 ones.
_LEGACY_TYPES = (OrcType.CALL, OrcType.REGS, OrcType.REGS_PARTIAL)
_REGS_TYPES = (OrcType.REGS, OrcType.REGS_PARTIAL)  # legacy kernels: these make the pc exact
# The bitfield of a C function's usual entry (sp_reg SP, type CALL) in each layout.
_CALL_SP_HIGH = {OrcLayout.SIGNAL: 0x02, OrcLayout.LEGACY: 0x00}
_NO_SIGNAL = bytes(b for b in range(256) if not b & 0x08)  # high bytes without the signal bit
_VERSION = re.compile(rb"Linux version (\d+)\.(\d+)")
_BASE_REGS: dict[int, int] = {OrcReg.R10: 10, OrcReg.R13: 13, OrcReg.DI: 5, OrcReg.DX: 1}


@dataclass(frozen=True, slots=True)
class OrcEntry:
    """One decoded ``.orc_unwind`` entry. ``signal``: the caller's pc is where it was stopped
    (an interrupted instruction), not a return address."""

    sp_offset: int
    bp_offset: int
    sp_reg: int
    bp_reg: int
    type: OrcType
    signal: bool


def decode_entry(sp_offset: int, bp_offset: int, bits: int, layout: OrcLayout) -> OrcEntry:
    """An entry from its three fields. Raises ValueError for a type no kernel writes."""
    sp_reg, bp_reg = bits & 0xF, (bits >> 4) & 0xF
    if layout is OrcLayout.SIGNAL:
        return OrcEntry(
            sp_offset, bp_offset, sp_reg, bp_reg, OrcType((bits >> 8) & 7), bool(bits >> 11 & 1)
        )  # OrcType raises ValueError for 5..7
    raw = (bits >> 8) & 3
    if raw == 3:
        raise ValueError(f"ORC type 3 in a legacy entry ({bits:#06x})")
    if sp_reg == OrcReg.UNDEFINED:
        kind = OrcType.END_OF_STACK if bits >> 10 & 1 else OrcType.UNDEFINED
    else:
        kind = _LEGACY_TYPES[raw]
    return OrcEntry(sp_offset, bp_offset, sp_reg, bp_reg, kind, kind in _REGS_TYPES)


def kernel_version(data: bytes) -> tuple[int, int] | None:
    """(major, minor) from the ``Linux version X.Y`` banner in a kernel image's bytes."""
    found = _VERSION.search(data)
    return None if found is None else (int(found[1]), int(found[2]))


def detect_layout(entries: bytes, version: tuple[int, int] | None = None) -> OrcLayout:
    """The layout of a table's entries. Most entries of any kernel are a C function's CALL with
    sp_reg SP, whose high byte is 0x02 from 6.4 on and 0x00 before; a set ``signal`` bit exists
    only from 6.4. ``version`` decides when the entries cannot (a tiny table)."""
    found = _layout_of_entries(entries)
    if found is not None:
        return found
    if version is not None and version < (6, 4):
        return OrcLayout.LEGACY
    return OrcLayout.SIGNAL


def _layout_of_entries(entries: bytes) -> OrcLayout | None:
    high = entries[5::ENTRY_SIZE]
    if high.translate(None, _NO_SIGNAL):  # a byte with the signal bit is left: a C-speed any()
        return OrcLayout.SIGNAL
    new, old = high.count(_CALL_SP_HIGH[OrcLayout.SIGNAL]), high.count(0)
    if new != old:
        return OrcLayout.SIGNAL if new > old else OrcLayout.LEGACY
    return None


class OrcTable:
    """The entries of one piece of code (the kernel image, a module), looked up by address."""

    __slots__ = ("_decoded", "_raw", "base", "end", "layout", "offsets")

    def __init__(
        self,
        base: int,
        offsets: Sequence[int],
        entries: bytes,
        layout: OrcLayout,
        end: int | None = None,
    ) -> None:
        if len(entries) != ENTRY_SIZE * len(offsets):
            raise ValueError(f"{len(offsets)} ORC ips but {len(entries)} bytes of entries")
        # Entry i covers base + offsets[i] on; small offsets rather than 64-bit addresses
        # make the list twice as fast to build. A cache hands them over as an array("q"),
        # which bisect searches as fast as a list and which loads without making 440 000 ints.
        self.base = base
        self.offsets = offsets  # ascending
        self._raw = entries
        self.layout = layout
        # Addresses past the last entry belong to no table (it is a section's end marker).
        self.end = end if end is not None else (base + offsets[-1] + 1 if offsets else base)
        self._decoded: Memo[int, OrcEntry] = Memo()

    @classmethod
    def from_sections(
        cls,
        ip_bytes: bytes,
        ip_addr: int,
        entries: bytes,
        layout: OrcLayout | None = None,
        version: tuple[int, int] | None = None,
    ) -> OrcTable:
        """A table from the two sections' bytes; ``ip_addr`` is the address of ``ip_bytes[0]``
        (a link address, or a runtime one for tables read from guest memory). Tables are sorted
        at build time (vmlinux) or when loaded (modules); an unsorted one is sorted here."""
        count = len(ip_bytes) // 4
        rel = struct.unpack(f"<{count}i", ip_bytes[: 4 * count])
        offsets = list(map(add, rel, range(0, 4 * count, 4)))
        if layout is None:
            layout = detect_layout(entries, version)
        if not all(map(le, offsets, islice(offsets, 1, None))):
            order = sorted(range(count), key=offsets.__getitem__)
            entries = b"".join(entries[6 * i : 6 * i + 6] for i in order)
            offsets = [offsets[i] for i in order]
        return cls(ip_addr, offsets, entries, layout)

    @classmethod
    def from_image(cls, image: ElfImage) -> OrcTable | None:
        """The table of a kernel image (vmlinux), None when it has no ORC sections."""
        ip_bytes = image.section(".orc_unwind_ip")
        ip_addr = image.section_addr(".orc_unwind_ip")
        entries = image.section(".orc_unwind")
        if ip_bytes is None or ip_addr is None or entries is None:
            return None
        layout = _layout_of_entries(entries)
        if layout is None:  # only then is the version banner searched for (in 7 MB)
            layout = detect_layout(entries, kernel_version(image.section(".rodata") or b""))
        return cls.from_sections(ip_bytes, ip_addr, entries, layout)

    def __len__(self) -> int:
        return len(self.offsets)

    def ip(self, index: int) -> int:
        """The first address entry ``index`` covers."""
        return (self.base + self.offsets[index]) & MASK64

    def entry(self, index: int) -> OrcEntry:
        """The decoded entry ``index``. Raises ValueError for an undecodable one."""
        found = self._decoded.get(index)
        if found is None:
            sp_offset, bp_offset, bits = _ENTRY.unpack_from(self._raw, ENTRY_SIZE * index)
            found = self._decoded.put(index, decode_entry(sp_offset, bp_offset, bits, self.layout))
        return found

    def index_of(self, pc: int) -> int | None:
        """The index of the entry covering ``pc`` (the last of those with the greatest ip <=
        pc, as the kernel's search), None outside the table."""
        if pc >= self.end:
            return None
        index = bisect_right(self.offsets, pc - self.base) - 1
        return None if index < 0 else index

    def lookup(self, pc: int) -> OrcEntry | None:
        """The entry covering link address ``pc``, None outside the table."""
        index = self.index_of(pc)
        return None if index is None else self.entry(index)


class OrcStep:
    """The caller of a frame by the ORC entry of its pc (``unwind_orc.c``'s rules).

    One rule more than the kernel's: code ORC leaves UNDEFINED (the retpoline and return
    thunks) is walked when the CPU stands on its first byte, a function's entry (``functions``
    says where functions start, at link addresses): the call just pushed the return address
    and nothing else. TCG stops at block starts, so samples land there (~1 % of kernel ones).
    Before 6.4 the thunks' hint (UNWIND_HINT_EMPTY) reads as END_OF_STACK, as at true ends
    (``entry_SYSCALL_64``, ``ret_from_fork``): there the rule holds only within ``thunks``, the
    link addresses ``__indirect_thunk_start`` .. ``__indirect_thunk_end`` of such kernels."""

    via = Via.ORC
    __slots__ = ("_entries", "bias", "functions", "table", "thunks")

    def __init__(
        self,
        table: OrcTable,
        bias: int = 0,
        functions: SymbolTable | None = None,
        thunks: tuple[int, int] | None = None,
    ) -> None:
        self.table = table
        self.bias = bias  # runtime address - link address (the KASLR slide)
        self.functions = functions
        self.thunks = thunks
        # runtime pc -> its entry (None: outside the table; NO_CFI: undecodable)
        self._entries: Memo[int, OrcEntry | StopReason | None] = Memo()

    def step(self, cur: Regs, pc: int, interrupted: bool, memory: PageCache) -> Outcome:
        link_pc = (pc - self.bias) & MASK64
        try:
            entry = self._entries[pc]
        except KeyError:
            entry = self._entries.put(pc, self._entry(link_pc))
        if entry is None or isinstance(entry, StopReason):
            return entry
        kind = entry.type
        if kind is OrcType.END_OF_STACK:
            if interrupted and self._in_thunks(link_pc) and self._at_entry(link_pc):
                return _return_address_at_sp(cur, memory)
            return StopReason.END
        if kind is OrcType.UNDEFINED:
            if interrupted and self._at_entry(link_pc):
                return _return_address_at_sp(cur, memory)
            return StopReason.NO_CFI  # the kernel gives up here too: its code is known, unwalkable
        sp = _caller_sp(entry, cur, memory)
        if isinstance(sp, StopReason):
            return sp
        if kind is OrcType.CALL:
            ra = memory.read_u64((sp - 8) & MASK64)
            if ra is None:
                return StopReason.READ_FAILED
            # Only sp and bp are known in a caller: ORC tracks no other register.
            new: Regs = {RIP: ra, RSP: sp, RBP: cur.get(RBP, 0)}
            signal = entry.signal
        else:
            found = _regs_frame(kind, sp, cur, memory)
            if isinstance(found, StopReason):
                return found
            new, signal = found
            signal = signal or entry.signal
        bp = _caller_bp(entry, sp, cur, memory)
        if isinstance(bp, StopReason):
            return bp
        if bp is not None:
            new[RBP] = bp
        # "*sp + offset": the stack pointer saved when call_on_stack switched to an IRQ stack;
        # the interrupted stack may lie anywhere, below this one too.
        return new, signal | NEW_STACK if entry.sp_reg == OrcReg.SP_INDIRECT else signal

    def _entry(self, link_pc: int) -> OrcEntry | StopReason | None:
        try:
            return self.table.lookup(link_pc)
        except ValueError:
            return StopReason.NO_CFI

    def _in_thunks(self, link_pc: int) -> bool:
        return self.thunks is not None and self.thunks[0] <= link_pc < self.thunks[1]

    def _at_entry(self, link_pc: int) -> bool:
        found = None if self.functions is None else self.functions.lookup(link_pc)
        return found is not None and found[1] == 0


def _return_address_at_sp(cur: Regs, memory: PageCache) -> Outcome:
    sp = cur[RSP]
    ra = memory.read_u64(sp)
    if ra is None:
        return StopReason.READ_FAILED
    return {RIP: ra, RSP: (sp + 8) & MASK64, RBP: cur.get(RBP, 0)}, False


def _caller_sp(entry: OrcEntry, cur: Regs, memory: PageCache) -> int | StopReason:
    """The address the entry's sp rule gives: the caller's sp, or the pt_regs/iret frame's."""
    reg, offset = entry.sp_reg, entry.sp_offset
    if reg == OrcReg.SP:
        return (cur[RSP] + offset) & MASK64
    if reg == OrcReg.BP:
        return (cur.get(RBP, 0) + offset) & MASK64
    if reg == OrcReg.SP_INDIRECT:  # since 5.12 "*sp + offset"; unused by earlier kernels
        slot = memory.read_u64(cur[RSP])
        return StopReason.READ_FAILED if slot is None else (slot + offset) & MASK64
    if reg == OrcReg.BP_INDIRECT:
        slot = memory.read_u64((cur.get(RBP, 0) + offset) & MASK64)
        return StopReason.READ_FAILED if slot is None else slot
    dwarf = _BASE_REGS.get(reg)
    value = None if dwarf is None else cur.get(dwarf)
    # A register base is only known where a pt_regs (or the CPU) gave it: the kernel's rule.
    return StopReason.NO_CFI if value is None else value


def _regs_frame(
    kind: OrcType, addr: int, cur: Regs, memory: PageCache
) -> tuple[Regs, bool] | StopReason:
    """The interrupted code's registers from a pt_regs (REGS) or an iret frame (REGS_PARTIAL) at
    ``addr``, and whether they are user mode's."""
    if kind is OrcType.REGS:
        data = memory.read(addr, PT_REGS.size)
        if data is None:
            return StopReason.READ_FAILED
        words = PT_REGS.unpack(data)
        new = dict(zip(PT_REGS_DWARF, words, strict=False))
        new[RIP], new[RSP] = words[PT_REGS_IP], words[PT_REGS_SP]
        return new, bool(words[PT_REGS_CS] & 3)
    data = memory.read(addr, IRET_FRAME.size)
    if data is None:
        return StopReason.READ_FAILED
    ip, cs, _flags, sp, _ss = IRET_FRAME.unpack(data)
    # The other registers are the ones the entry code has not touched yet: those of ``cur``.
    partial = dict(cur)
    partial[RIP], partial[RSP] = ip, sp
    return partial, bool(cs & 3)


def _caller_bp(entry: OrcEntry, sp: int, cur: Regs, memory: PageCache) -> int | StopReason | None:
    """The caller's bp by the entry's bp rule; None: undefined, so the bp is the frame's own or
    the one the pt_regs held."""
    reg = entry.bp_reg
    if reg == OrcReg.UNDEFINED:
        return None
    if reg == OrcReg.PREV_SP:
        addr = (sp + entry.bp_offset) & MASK64
    elif reg == OrcReg.BP:
        addr = (cur.get(RBP, 0) + entry.bp_offset) & MASK64
    else:
        return StopReason.NO_CFI
    bp = memory.read_u64(addr)
    return StopReason.READ_FAILED if bp is None else bp
