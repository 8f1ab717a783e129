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

The entries are followed by ``orcstep.OrcStep``; this module reads them, and names
the facts of the x86_64 ABI they refer to (``pt_regs``, the registers ORC names).
"""

from __future__ import annotations

import contextlib
import enum
import re
import struct
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from operator import add, le

from qmpprof.elf.image import ElfImage
from qmpprof.linux.cache import OrcIndex
from qmpprof.memo import Memo

MASK64 = (1 << 64) - 1
ENTRY_SIZE = 6
_ENTRY = struct.Struct("<hhH")


@dataclass(frozen=True, slots=True)
class PtRegs:
    """Where a ``struct pt_regs`` (the registers the entry code saves on a trap, an interrupt or
    a system call) keeps each register: (DWARF number, byte offset) pairs, and ip, cs, sp."""

    size: int
    regs: tuple[tuple[int, int], ...]
    ip: int
    cs: int
    sp: int


# struct pt_regs on x86_64: 21 u64, r15 r14 r13 r12 bp bx r11 r10 r9 r8 ax cx dx si di orig_ax
# ip cs flags sp ss (the entry code's ABI: the same on 5.10, 6.1, 6.12 and 7.2); as DWARF numbers.
X86_64_PT_REGS = PtRegs(
    size=21 * 8,
    regs=tuple((dwarf, 8 * i) for i, dwarf in enumerate((15, 14, 13, 12, 6, 3, 11, 10, 9, 8,
                                                         0, 2, 1, 4, 5))),
    ip=16 * 8,
    cs=17 * 8,
    sp=19 * 8,
)  # fmt: skip
IRET_FRAME = struct.Struct("<5Q")  # ip, cs, flags, sp, ss: what the CPU pushes, pt_regs' tail


@dataclass(frozen=True, slots=True)
class OrcRegs:
    """What each ORC register number means in one kernel's tables (``ORC_REG_*`` of its
    ``orc_types.h``): the bases of an entry's sp and bp rules, and the general registers a
    ``pt_regs`` gave (ORC number, x86_64 DWARF number). None: a base these tables never use,
    or that could not be told."""

    undefined: int
    prev_sp: int
    sp: int
    bp: int
    sp_indirect: int | None
    bp_indirect: int | None
    general: tuple[tuple[int, int], ...] = ()

    def dwarf(self, reg: int) -> int | None:
        """The DWARF number of general register ``reg``, None when it is no such register."""
        return next((dwarf for orc, dwarf in self.general if orc == reg), None)


# The numberings of the kernels seen (arch/x86/include/asm/orc_types.h of each): 4.14 to 6.x
# (checked on Debian's 5.10, 6.1 and 6.12), and the one 7.x renumbered (checked on 7.2.13):
# UNDEFINED, PREV_SP, SP, BP, SP_INDIRECT, BP_INDIRECT, then DX, DI, R10, R13 (and AX).
CLASSIC = OrcRegs(0, 1, 5, 4, 9, 8, ((2, 1), (3, 5), (6, 10), (7, 13)))
RENUMBERED = OrcRegs(0, 8, 3, 4, 9, 10, ((1, 0), (2, 1), (5, 5), (6, 10), (7, 13)))
# .orc_header (6.4 on) holds the SHA-1 of the kernel's orc_types.h: which of them it is.
_BY_HEADER = {
    "fe5d32bf581bd63b2ca9a5c65ba5a625eab3fe24": CLASSIC,  # 6.4 to 6.x (seen: 6.12)
    "137c36ad7627c4dd55932176bb0ecdbd5041fc82": RENUMBERED,  # 7.x (seen: 7.2.13)
}


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
# The x86_64 kernel's thunks that jump through a register, by their kallsyms names (the same
# prefixes from 5.10 to 7.3, once ``unaliased``): every one (call-depth ones too, 6.2 on), and
# the retpolines, laid out as "call 1f; int3; 1: mov %reg, (%rsp); ret"
# (__x86_indirect_thunk_rax, __x86_indirect_thunk_array ...).
INDIRECT_THUNKS = "__x86_indirect_"
RETPOLINE_THUNK = "__x86_indirect_thunk_"
# From 6.16 (Debian's 6.16 to 7.3; not 6.12) the code the early startup code calls has a second
# name with this prefix (the startup objects are linked with their symbols prefixed), and
# kallsyms lists it first at the address, so that it is the name a function lookup gives and
# /proc/kallsyms shows: __pi___x86_indirect_thunk_rax, __pi___x86_return_thunk.
PI_ALIAS = "__pi_"


def unaliased(name: str) -> str:
    """A kernel function's name without the prefix of its startup-code alias (``PI_ALIAS``),
    for telling what kind of code it is (a frame keeps the name kallsyms gives)."""
    return name.removeprefix(PI_ALIAS)


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
    if sp_reg == CLASSIC.undefined:  # (legacy kernels number the registers the classic way)
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

    __slots__ = ("_decoded", "_raw", "base", "end", "layout", "offsets", "regs")

    def __init__(
        self,
        base: int,
        offsets: Sequence[int],
        entries: bytes,
        layout: OrcLayout,
        end: int | None = None,
        regs: OrcRegs = CLASSIC,
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
        self.regs = regs  # how its kernel numbers the registers (``numbering``)
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
        regs: OrcRegs = CLASSIC,
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
        return cls(ip_addr, offsets, entries, layout, regs=regs)

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

    def index(self) -> OrcIndex:
        """What the kernel's cache keeps of the table (``platform.OwnTables``)."""
        return OrcIndex(self.base, self.end, self.layout.value, self.offsets)

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


def numbering(
    header: bytes | None, table: OrcTable, function_starts: Sequence[int]
) -> tuple[OrcRegs, str | None]:
    """How the kernel that wrote ``table`` numbers ORC registers, and a line when it is not a
    numbering seen before. Before 6.4 (no ``.orc_header``) every kernel numbered them the
    classic way; from 6.4 the header's hash names its numbering; a hash not seen before is
    told from the entries (``core_of``): the seen numbering they agree with, else only what
    they show (the indirect bases and general registers are then unknown)."""
    if header is None:
        return CLASSIC, None
    known = known_numbering(header)
    if known is not None:
        return known, None
    found = core_of(table, function_starts)
    for regs in (CLASSIC, RENUMBERED):
        if found == _core(regs):
            return regs, None
    if found is None:
        return CLASSIC, "ORC tables numbered as no kernel seen, too few entries to tell how"
    undefined, prev_sp, sp, bp = found
    note = (
        f"ORC registers numbered as no kernel seen (SP {sp}, BP {bp}, PREV_SP {prev_sp}):"
        " frames found through the others end there"
    )
    return OrcRegs(undefined, prev_sp, sp, bp, None, None), note


def known_numbering(header: bytes) -> OrcRegs | None:
    """The numbering an ``.orc_header`` names, None when its hash is not one seen before."""
    return _BY_HEADER.get(header.hex())


def core_of(table: OrcTable, function_starts: Sequence[int]) -> tuple[int, int, int, int] | None:
    """(UNDEFINED, PREV_SP, SP, BP) as the entries show them: SP is the base of a function's
    entry at its first byte (a call: sp + 8), PREV_SP the base of a saved bp (below the
    caller's sp), BP the other base of frames 16 bytes deep that saved bp (frame pointers),
    UNDEFINED the bp base of most frames. None when too few entries to tell."""
    at_start: Counter[int] = Counter()
    for start in function_starts[:: max(1, len(function_starts) // 2000)]:
        with contextlib.suppress(ValueError):
            entry = table.lookup(start)
            if entry is not None and entry.type is OrcType.CALL and entry.sp_offset == 8:
                at_start[entry.sp_reg] += 1
    saved: Counter[int] = Counter()
    deep: Counter[int] = Counter()
    plain: Counter[int] = Counter()
    for index in range(0, len(table), max(1, len(table) // 20000)):
        with contextlib.suppress(ValueError):
            entry = table.entry(index)
            if entry.type is OrcType.CALL:
                plain[entry.bp_reg] += 1
                if entry.bp_offset < 0:
                    saved[entry.bp_reg] += 1
                if entry.sp_offset == 16 and entry.bp_offset == -16:
                    deep[entry.sp_reg] += 1
    if min(len(at_start), len(saved), len(plain)) == 0 or sum(at_start.values()) < 20:
        return None
    sp = at_start.most_common(1)[0][0]
    bp = next((reg for reg, _ in deep.most_common() if reg != sp), None)
    if bp is None:
        return None
    return plain.most_common(1)[0][0], saved.most_common(1)[0][0], sp, bp


def _core(regs: OrcRegs) -> tuple[int, int, int, int]:
    return regs.undefined, regs.prev_sp, regs.sp, regs.bp
