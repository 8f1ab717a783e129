"""Frozen value types that travel along the data path: registers, frames, stacks, samples."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Default split between user and kernel space (the mission's convention).
KERNEL_BOUNDARY = 0xFFFF_FFFF_8000_0000

# DWARF register numbers of x86_64 (System V psABI, figure 3.36).
DWARF_REGS: tuple[str, ...] = (
    "rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip",
)  # fmt: skip
RIP = 16
RSP = 7
RBP = 6


@dataclass(frozen=True, slots=True)
class Registers:
    """The registers of one vCPU at the moment the guest was stopped.

    ``gprs`` maps DWARF register numbers (0..16, 16 being RIP) to values; in 32-bit or real mode
    the 32-bit values are zero-extended and ``long_mode`` is False.
    """

    cpu: int
    rip: int
    rsp: int
    rbp: int
    cpl: int
    cr3: int  # the whole register, never masked: a PAE CR3 (32-byte aligned) keeps bits 5..11
    fs_base: int = 0
    gs_base: int = 0
    long_mode: bool = True
    halted: bool = False
    gprs: dict[int, int] = field(default_factory=dict, compare=False, hash=False)


class StopReason(enum.Enum):
    """Why the walk of one stack ended."""

    END = "end"  # reached the outermost frame (return address 0, RBP 0, or CFI says undefined)
    NO_CFI = "no-cfi"  # no rule could unwind the frame
    READ_FAILED = "read-failed"  # the stack memory could not be read
    LOOP = "loop"  # a frame repeated or the stack pointer did not grow
    DEPTH = "depth"  # the depth cap was reached
    BAD_RETURN = "bad-return"  # a return address outside any plausible code


@dataclass(frozen=True, slots=True)
class Mapping:
    """Where one module's code sits in the guest: a kernel image, a kernel module, a program or a
    library (``path`` and ``build_id`` when a file was matched), or code known only by its range.
    Frames point at their mapping; pprof writes one mapping per module."""

    name: str
    start: int
    end: int
    kernel: bool
    bias: int = 0  # runtime address - link address
    path: str | None = None
    build_id: str | None = None
    file_offset: int = 0  # where ``start`` is in the file (pprof turns addresses into file offsets)


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a stack, as data: names are made from it only when a profile is written.

    ``pc`` is the frame's address (the leaf's RIP, a caller's return address). ``symbol`` is
    None when no symbol covers the address; ``offset`` is ``pc`` minus the symbol's start.
    ``file``/``line`` come from DWARF when the module has it. The functions inlined at a pc are
    frames of their own with ``inlined`` set, innermost first, before the real function's frame.
    """

    pc: int
    kernel: bool
    symbol: str | None = None
    offset: int = 0
    module: Mapping | None = None
    file: str | None = None
    line: int | None = None
    inlined: bool = False

    @property
    def module_name(self) -> str | None:
        return None if self.module is None else self.module.name


@dataclass(frozen=True, slots=True)
class Stack:
    """Frames ordered leaf first (index 0 is where the CPU was)."""

    frames: tuple[Frame, ...]
    stop: StopReason = StopReason.END

    @property
    def truncated(self) -> bool:
        return self.stop is not StopReason.END


class Mode(enum.Enum):
    KERNEL = "kernel"
    USER = "user"


@dataclass(frozen=True, slots=True)
class Process:
    """A process as identified in the guest: pid (None when the guest gives none), program name
    (None when no ELF matched) and the address space (CR3); and the thread that ran, where the
    guest tells threads apart (Linux: the task's own pid and comm; a process's threads are
    several Process values with one label)."""

    pid: int | None
    program: str | None
    cr3: int
    tid: int | None = None
    thread: str | None = None

    @property
    def label(self) -> str:
        if self.pid is None:
            space = f"cr3={self.cr3:#x}"
            return space if self.program is None else f"{self.program} ({space})"
        return f"{self.program or '[unknown]'} (pid {self.pid})"


@dataclass(frozen=True, slots=True)
class Sample:
    """One vCPU's state at one tick, unwound."""

    time: float  # seconds since the start of the run (wall clock)
    cpu: int
    mode: Mode
    cpl: int
    cr3: int
    stack: Stack
    process: Process | None = None
