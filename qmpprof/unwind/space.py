"""Where code lives in one guest address space: modules (ELF images at a bias) and lookups.

An AddressSpace is immutable once built, so it also carries the per-pc caches of the stack
walker (module + CFI row) and of symbolization (frames): a sampler keeps one AddressSpace per
process and the caches stay warm across samples.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.elf.image import ElfImage
from qmpprof.elf.lines import LineTable
from qmpprof.elf.symbols import SymbolTable
from qmpprof.model import Frame
from qmpprof.unwind.cfi import CfiTable, Rule

_CACHE_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class Module:
    """Code loaded in the guest at [start, end); ``bias`` = runtime address - link address."""

    name: str
    start: int
    end: int
    kernel: bool
    bias: int = 0
    symbols: SymbolTable | None = None
    cfi: CfiTable | None = None
    code: bytes | None = None  # .text, for prologue analysis
    code_addr: int = 0  # link address of code[0]
    lines: LineTable | None = None  # DWARF source lines, for --lines

    @classmethod
    def from_image(cls, image: ElfImage, kernel: bool, bias: int = 0) -> Module:
        low, high = image.load_range
        return cls(
            image.name, low + bias, high + bias, kernel, bias,
            image.symbols, image.cfi, image.text_bytes, image.text_addr, image.lines,
        )  # fmt: skip


class AddressSpace:
    """The modules of one address space, searchable by runtime pc (results cached per pc)."""

    def __init__(self, modules: Sequence[Module]) -> None:
        self.modules = tuple(sorted(modules, key=lambda m: m.start))
        self._starts = [m.start for m in self.modules]
        self._found: dict[int, Module | None] = {}
        # Unwinder.symbolize's cache: (pc, exact, kernel boundary, lines) -> frames at pc
        self.frames: dict[tuple[int, bool, int, bool], tuple[Frame, ...]] = {}
        self._rules: dict[int, tuple[Module | None, Rule | None]] = {}

    def find(self, pc: int) -> Module | None:
        try:
            return self._found[pc]
        except KeyError:
            pass
        i = bisect_right(self._starts, pc) - 1
        module = self.modules[i] if i >= 0 and pc < self.modules[i].end else None
        if len(self._found) >= _CACHE_LIMIT:
            self._found.clear()
        self._found[pc] = module
        return module

    def rule_at(self, pc: int) -> tuple[Module | None, Rule | None]:
        """The module holding runtime address ``pc`` and its CFI row there (cached per pc)."""
        try:
            return self._rules[pc]
        except KeyError:
            pass
        module = self.find(pc)
        rule = None
        if module is not None and module.cfi is not None:
            rule = module.cfi.row_for(pc - module.bias)
        if len(self._rules) >= _CACHE_LIMIT:
            self._rules.clear()
        self._rules[pc] = (module, rule)
        return module, rule
