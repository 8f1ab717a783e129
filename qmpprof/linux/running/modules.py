"""A Linux guest's loaded kernel modules, read from guest memory: no ``.ko`` needed.

The ``modules`` list links every ``struct module`` (through its ``list`` member). Of each: its
name, where its text is (``mem[MOD_TEXT]`` from 6.4, ``core_layout`` before), its symbols as the
kernel keeps them for kallsyms (``kallsyms->symtab``/``strtab``: Elf64_Sym at runtime
addresses) and its own unwinding tables where its platform reads them (``OwnSteps``: x86_64's
ORC, ``arch.orc_unwind_ip``/``orc_unwind``; an arm64 ``mod_arch_specific`` has none). Offsets
come from the kernel's BTF. Each module becomes a ``Module`` named ``[name]``, unwound by its
own tables; frames in it are named ``function [name]``. A module without them (arm64) is
unwound as the kernel's own code is there: by frame records, with prologue analysis of its
text, read once: a leaf function keeps no record, and its caller is told only by the code (its
return address still in x30).

Read when a run starts, through QMP (memsave needs no stop), and again every few seconds while
the guest runs (``ModuleList``: the list's links, then only the modules not seen before).

A guest may be hostile or damaged: what it claims is read up to a ceiling per module (its
name, its symbols, its text) and across modules (their text), and a ceiling that cuts is told
in one line (``ModuleList.notes``); the rest of the run goes on.

With source lines wanted (``debug``: where sysfs's view of a module is), a module's lines come
from its debug file by build-id (``moduledebug``), fetched when the module is first read.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.linux.btf import Btf, Kind
from qmpprof.linux.running.moduledebug import DebugLayout, module_lines
from qmpprof.memory import Reader, read_ints, read_one
from qmpprof.model import Mapping
from qmpprof.pagecache import PAGE
from qmpprof.unwind.space import Module
from qmpprof.unwind.steps import UnwindStep

# A module's own unwinding steps, as its platform reads them (x86_64: its ORC tables): of the
# ``struct module`` at an address, by the kernel's layout, for code at a bias; none: ().
OwnSteps = Callable[[Reader, int, "ModuleLayout", int], Awaitable[Sequence[UnwindStep]]]

MAX_MODULES = 4096
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym
_STT_FUNC = 2
# Symbols kept of one module: several times the most a real one has (amdgpu: some 30,000).
MAX_SYMBOLS = 1 << 17
_MAX_STRTAB = 16 << 20  # a module's string table read at most: a name past it is damage
_KSYM_NAME_LEN = 512  # the longest symbol name the kernel keeps, and its NUL
# Text read for prologue analysis (modules without ORC tables): of one module (the largest known:
# a few MB) and of all of them together.
MAX_TEXT = 32 << 20
TEXT_BUDGET = 64 << 20
_NAME_MAX = 256  # bytes of a module's name read at most (MODULE_NAME_LEN: 56)


@dataclass(frozen=True, slots=True)
class ModuleLayout:
    """Byte offsets in ``struct module`` (and the structs it points to), from BTF."""

    list: int
    name: int
    name_size: int
    text_base: int  # void *: the text's start
    text_size: int  # unsigned int: the text's size
    kallsyms: int  # struct mod_kallsyms *
    symtab: int
    num_symtab: int
    strtab: int
    orc: tuple[int, int, int] | None  # arch.num_orcs, .orc_unwind_ip, .orc_unwind; None: none

    @classmethod
    def from_btf(cls, btf: Btf) -> ModuleLayout:
        """Raises KeyError naming what this kernel's BTF lacks."""
        field = btf.offset_of
        name = btf.field("module.name")
        try:
            mem = btf.field("module.mem")  # 6.4 on: mem[MOD_TEXT]
            element = btf.struct("module_memory")
            text = mem.offset + _mod_text(btf) * btf.size_of(element.id)
            text_base = text + field("module_memory.base")
            text_size = text + field("module_memory.size")
        except KeyError:
            text_base = field("module.core_layout.base")
            text_size = field("module.core_layout.text_size")
        orc: tuple[int, int, int] | None = None  # none in a module of this kernel (arm64)
        with contextlib.suppress(KeyError):
            arch = "module.arch."
            orc = (
                field(arch + "num_orcs"),
                field(arch + "orc_unwind_ip"),
                field(arch + "orc_unwind"),
            )
        return cls(
            list=field("module.list"),
            name=name.offset,
            name_size=btf.array(name.type_id)[1],
            text_base=text_base,
            text_size=text_size,
            kallsyms=field("module.kallsyms"),
            symtab=field("mod_kallsyms.symtab"),
            num_symtab=field("mod_kallsyms.num_symtab"),
            strtab=field("mod_kallsyms.strtab"),
            orc=orc,
        )


def _mod_text(btf: Btf) -> int:
    """``MOD_TEXT`` of ``enum mod_mem_type``: the element of ``module.mem`` that holds a
    module's text."""
    found = btf.find("mod_mem_type", Kind.ENUM)
    if found is None:
        raise KeyError("enum mod_mem_type")
    return btf.enum_values(found)["MOD_TEXT"]


class ModuleList:
    """The guest's module list as last read. ``refresh`` walks the list's links (one read a
    module) and reads in full only the modules it has not seen: cheap enough to run every few
    seconds while the guest runs, so that a module loaded after the run started gets named.
    ``notes``: a line for each module a ceiling cut (MAX_SYMBOLS, MAX_TEXT, TEXT_BUDGET)."""

    def __init__(
        self,
        read: Reader,
        head: int,
        layout: ModuleLayout,
        own_steps: OwnSteps | None,
        arch: InstructionSet,
        debug: DebugLayout | None = None,
    ) -> None:
        self.read, self.head, self.layout, self.own_steps = read, head, layout, own_steps
        self.arch = arch
        self.debug = debug  # where modules' build-ids and sections are: lines wanted
        self.known: dict[int, Module | None] | None = None  # struct module -> Module, in order
        self.notes: list[str] = []
        self._text: dict[int, int] = {}  # struct module -> bytes of its text kept

    @property
    def read_whole(self) -> bool:
        """Whether the list and every module in it were read (reads of a running guest may
        fail for a while: an arm64 vCPU in user mode does not see the kernel, KPTI)."""
        return self.known is not None and None not in self.known.values()

    async def refresh(self) -> list[Module] | None:
        """The modules loaded now, or None when the list holds the same ones as last time, all
        read (or its head could not be read). A module that could not be read is tried again."""
        found = await self._structs()
        if found is None or (self.read_whole and found == list(self.known or {})):
            return None
        known = self.known or {}
        fresh = {at: known[at] for at in found if known.get(at) is not None}
        self._text = {at: size for at, size in self._text.items() if at in fresh}
        for at in found:
            if fresh.get(at) is None:
                fresh[at] = await self._read_module(at, TEXT_BUDGET - sum(self._text.values()))
        self.known = {at: fresh[at] for at in found}
        return [m for m in self.known.values() if m is not None]

    async def _structs(self) -> list[int] | None:
        out: list[int] = []
        (node,) = await read_ints(self.read, [(self.head, 8)])
        if node is None:
            return None
        seen = {self.head}
        while node is not None and node not in seen and len(seen) <= MAX_MODULES:
            seen.add(node)
            out.append(node - self.layout.list)
            (node,) = await read_ints(self.read, [(node, 8)])
        return out

    async def _read_module(self, at: int, text_left: int) -> Module | None:
        """The module at ``at``, its text read when it needs it and it fits ``text_left``
        bytes."""
        read, layout, arch = self.read, self.layout, self.arch
        raw_name = await read_one(read, at + layout.name, min(layout.name_size, _NAME_MAX))
        base, size = await read_ints(read, [(at + layout.text_base, 8), (at + layout.text_size, 4)])
        if raw_name is None or not base or not size or base < arch.shared_from:
            return None
        name = raw_name.split(b"\0", 1)[0].decode("utf-8", "replace")
        symbols = await _symbols(read, at, layout, base, base + size)
        if symbols is None:
            return None  # not readable now: read again (ModuleList)
        if symbols.cut:
            self.notes.append(
                f"module {name}: {symbols.cut} symbols, the first {MAX_SYMBOLS:,} kept"
            )
        named = symbols.table if len(symbols.table) else None
        mapping = Mapping(f"[{name}]", base, base + size, True)
        own: Sequence[UnwindStep] = ()
        if self.own_steps is not None:
            own = await self.own_steps(read, at, layout, mapping.bias)
        lines = None
        if self.debug is not None:
            lines = await module_lines(read, at, name, self.debug, self.notes)
        if own:
            return Module.build(mapping, arch, symbols=named, lines=lines, own=own)
        if size > min(MAX_TEXT, text_left):
            self.notes.append(
                f"module {name}: {size:,} bytes of text not read (at most {MAX_TEXT:,} a module,"
                f" {TEXT_BUDGET:,} in all): its frames without prologue analysis"
            )
            return Module.build(mapping, arch, symbols=named, lines=lines)
        code = await read_one(read, base, size)
        if code is None:
            return None
        self._text[at] = size
        return Module.build(mapping, arch, symbols=named, lines=lines, code=code, code_addr=base)


@dataclass(frozen=True, slots=True)
class _Symbols:
    table: SymbolTable
    cut: int = 0  # the count the module claimed, when more than MAX_SYMBOLS (0: none cut)


_NO_SYMBOLS = _Symbols(SymbolTable(()))


async def _symbols(
    read: Reader, at: int, layout: ModuleLayout, low: int, high: int
) -> _Symbols | None:
    """The module's function symbols (an empty table: it has none); None where a read failed
    (a running guest's reads fail for a while: an arm64 vCPU at EL0 does not see the kernel)."""
    (kallsyms,) = await read_ints(read, [(at + layout.kallsyms, 8)])
    if kallsyms is None:
        return None
    if not kallsyms:
        return _NO_SYMBOLS
    symtab, count, strtab = await read_ints(
        read,
        [(kallsyms + layout.symtab, 8), (kallsyms + layout.num_symtab, 4),
         (kallsyms + layout.strtab, 8)],
    )  # fmt: skip
    if symtab is None or count is None or strtab is None:
        return None
    if not symtab or not strtab or not count:
        return _NO_SYMBOLS
    raw = await read_one(read, symtab, min(count, MAX_SYMBOLS) * _SYM.size)
    if raw is None:
        return None
    entries = [
        (name, value, size)
        for name, info, _other, _shndx, value, size in _SYM.iter_unpack(raw)
        if info & 0xF == _STT_FUNC and low <= value < high and name < _MAX_STRTAB
    ]
    if not entries:
        return _NO_SYMBOLS
    last = max(name for name, _, _ in entries)
    names = await read_one(read, strtab, last + _KSYM_NAME_LEN)
    if names is None:  # the table ends near the end of its mapping (6.12's arm64 module)
        names = await read_one(read, strtab, last + (-(strtab + last) % PAGE or PAGE))
    if names is None:
        return None
    symbols = []
    for name, value, size in entries:
        end = names.find(b"\0", name)  # one search a name: never a copy of the table's rest
        if end >= 0:
            symbols.append(Symbol(value, size, names[name:end].decode("utf-8", "replace")))
    return _Symbols(SymbolTable(symbols), count if count > MAX_SYMBOLS else 0)
