"""Where code lives in one guest address space: modules (code at a bias) and lookups by pc.

A Module is what the walker and the namer need of one piece of code: its mapping (name, range,
bias, file), the unwinding steps it supports, its symbols and source lines, and its code for
tail-call frames where its provider gives it (a kernel image). An AddressSpace is immutable
once built, so it also carries the per-pc caches of the walker (module) and of frame
resolution: a sampler keeps one AddressSpace per process and the caches stay warm.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qmpprof.arch.base import InstructionSet
from qmpprof.dwarf.cfi import CfiTable
from qmpprof.elf.image import ElfImage
from qmpprof.elf.lines import LineTable
from qmpprof.elf.symbols import SymbolTable
from qmpprof.memo import Memo
from qmpprof.model import Frame, Mapping
from qmpprof.unwind.order import steps_for
from qmpprof.unwind.steps import ExceptionEntry, UnwindStep
from qmpprof.unwind.tailcall import CodeImage, TailCallFinder

if TYPE_CHECKING:
    from qmpprof.elf.trapframe import TrapFrameLayout


@dataclass(frozen=True, slots=True, eq=False)
class Module:
    """Code loaded in the guest at [start, end), with what it offers for unwinding and naming.
    No steps: frame pointers, in the walker's instruction set. ``outermost``: the runtime
    [start, end) of a program's entry function (its ELF's ``e_entry``), which nothing calls: a
    walk that reaches it is whole."""

    mapping: Mapping
    steps: tuple[UnwindStep, ...] = ()
    symbols: SymbolTable | None = None
    lines: LineTable | None = None  # DWARF source lines and inlined functions
    calls: CodeImage | None = None  # its code and functions, searched for tail-call frames
    outermost: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        return self.mapping.name

    @property
    def start(self) -> int:
        return self.mapping.start

    @property
    def end(self) -> int:
        return self.mapping.end

    @property
    def kernel(self) -> bool:
        return self.mapping.kernel

    @property
    def bias(self) -> int:
        return self.mapping.bias

    @classmethod
    def build(
        cls,
        mapping: Mapping,
        arch: InstructionSet,
        *,
        cfi: CfiTable | None = None,
        code: bytes | None = None,
        code_addr: int = 0,
        symbols: SymbolTable | None = None,
        lines: LineTable | None = None,
        own: Sequence[UnwindStep] = (),
        calls: CodeImage | None = None,
        starts: Callable[[], Sequence[int]] | None = None,
        entry: ExceptionEntry | None = None,
        trap: TrapFrameLayout | None = None,
        outermost: tuple[int, int] | None = None,
    ) -> Module:
        """A module with the unwinding steps what it provides allows (``code`` starts at link
        address ``code_addr``; ``starts`` guesses where its functions start, asked the first
        time a frame needs it; ``entry``: a kernel's exception code; ``own``: steps its guest OS
        brings that cover all of its code; ``trap``: the trap frame its DWARF describes), for
        the instruction set ``arch``."""
        steps = steps_for(
            mapping.bias, arch, cfi=cfi, code=code, code_addr=code_addr, symbols=symbols, own=own,
            starts=starts, entry=entry, trap=trap,
        )  # fmt: skip
        return cls(mapping, steps, symbols, lines, calls, outermost)

    @classmethod
    def from_image(
        cls,
        image: ElfImage,
        kernel: bool,
        bias: int = 0,
        trap: TrapFrameLayout | None = None,
        arch: InstructionSet | None = None,
    ) -> Module:
        """``arch``: the walker's instruction set under the guest's translation settings (its
        pointer-authentication sizes, aarch64's ``translated``), taken where it is the image's
        own; else the image's, which knows none."""
        if arch is None or arch.name != image.arch.name:
            arch = image.arch
        low, high = image.load_range
        mapping = Mapping(image.name, low + bias, high + bias, kernel, bias, image.path,
                          image.build_id, image.load_offset)  # fmt: skip
        return cls.build(
            mapping, arch, cfi=image.cfi, code=image.text_bytes, code_addr=image.text_addr,
            symbols=image.symbols, lines=image.lines,
            # Kernel code does not end in calls that never return often enough to pay for a
            # guess over all of a kernel's text (over a second for a vmlinux) in a pause.
            starts=None if kernel else lambda: image.function_starts, trap=trap,
            outermost=None if kernel else _entry_function(image, bias),
        )  # fmt: skip


def _entry_function(image: ElfImage, bias: int) -> tuple[int, int] | None:
    """The runtime [start, end) of the function at the program's entry point (``e_entry``,
    where the loader jumps: ``_start``), by its symbol; None without one."""
    found = None if image.entry is None else image.symbols.extent(image.entry)
    return None if found is None else (found[0] + bias, found[1] + bias)


class AddressSpace:
    """The modules of one address space, searchable by runtime pc (results cached per pc).
    ``user_gone``: a process's space whose user half was released (it is exiting): a walk
    that reaches user code from the kernel ends there, whole (``StopReason.USER_GONE``)."""

    def __init__(self, modules: Sequence[Module], *, user_gone: bool = False) -> None:
        self.modules = tuple(sorted(modules, key=lambda m: m.start))
        self.user_gone = user_gone
        images = [m.calls for m in self.modules if m.calls is not None]
        # The search of the modules that give their code: one per set of them, so that every
        # process's space (the kernel's modules and its own) shares its caches.
        self.tail_calls = TailCallFinder.of(images) if images else None
        self._starts = [m.start for m in self.modules]
        self._found: Memo[int, Module | None] = Memo()
        # Unwinder.resolve's cache: (pc, exact, kernel boundary, lines) -> frames at pc
        self.frames: Memo[tuple[int, bool, int, bool], tuple[Frame, ...]] = Memo()

    def find(self, pc: int) -> Module | None:
        try:
            return self._found[pc]
        except KeyError:
            pass
        i = bisect_right(self._starts, pc) - 1
        module = self.modules[i] if i >= 0 and pc < self.modules[i].end else None
        return self._found.put(pc, module)
