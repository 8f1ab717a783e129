"""The ordered unwinding steps of a module, chosen from what it provides (``steps_for``): the
one place that names every step, so that the steps (``steps``, ``entry``, ``scan``) import none
of each other's builders and the package has no import cycle. Steps a guest OS brings (x86_64
Linux's ORC step) are handed in by whoever builds the module: unwind names no guest OS."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qmpprof.arch.base import InstructionSet
from qmpprof.dwarf.cfi import CfiTable
from qmpprof.elf.symbols import SymbolTable
from qmpprof.elf.trapframe import TrapFrameLayout
from qmpprof.unwind.scan import ReturnScanStep
from qmpprof.unwind.steps import (
    CfiStep,
    ExceptionEntry,
    PrologueStep,
    UnwindStep,
    frame_pointer_only,
)
from qmpprof.unwind.trapframe import TrapFrameStep


def steps_for(
    bias: int,
    arch: InstructionSet,
    *,
    cfi: CfiTable | None = None,
    code: bytes | None = None,
    code_addr: int = 0,
    symbols: SymbolTable | None = None,
    own: Sequence[UnwindStep] = (),
    starts: Callable[[], Sequence[int]] | None = None,
    entry: ExceptionEntry | None = None,
    trap: TrapFrameLayout | None = None,
) -> tuple[UnwindStep, ...]:
    """The steps for a module at ``bias``, from what it provides, best first: the steps its
    guest OS brings (``own``: x86_64 Linux's ORC tables) alone, as they cover all of its code;
    else its exception entry code (``entry.py``, ``savedregs.py``), CFI, the trap frame its
    DWARF describes (``trapframe.py``), prologue analysis, the code followed to its return
    (``scan.py``; first, for an interrupted interrupt entry), frame pointers."""
    if own:
        return tuple(own)
    steps: list[UnwindStep] = []
    if entry is not None:
        steps.append(entry.step(bias, arch))
    if cfi is not None:
        steps.append(CfiStep(cfi, bias, arch))
    if trap is not None and code:
        steps.append(TrapFrameStep(trap, code, code_addr, bias, arch))
    if code:
        arch.prepare()  # now: not inside the first pause that needs it
        # An interrupt entry caught at its start looks to prologue analysis like any function
        # entry: the scan to its ``iret`` tells it first.
        steps.append(ReturnScanStep(code, code_addr, bias, arch, traps_only=True))
        steps.append(PrologueStep(code, code_addr, bias, symbols, arch))
        steps.append(ReturnScanStep(code, code_addr, bias, arch, starts))
    steps.extend(frame_pointer_only(arch))
    return tuple(steps)
