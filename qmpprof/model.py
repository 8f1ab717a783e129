"""Frozen value types that travel along the data path: registers, frames, stacks, samples."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Registers:
    """The registers of one vCPU at the moment the guest was stopped, in the terms of the
    instruction set it was running (``isa``, a name of ``qmpprof.arch``'s registry).

    ``gprs`` maps that instruction set's DWARF register numbers to values (``pc``, ``sp`` and
    ``fp`` among them); ``user``: the CPU ran unprivileged code; ``space``: the root of the page
    tables in use, whole (a PAE CR3 keeps its bits 5..11); ``special``: the instruction set's own
    state by name (x86: ``cpl``, ``fs_base``, ``gs_base``), read by its ``qmpprof.arch`` module.
    """

    cpu: int
    isa: str
    pc: int
    sp: int
    fp: int
    user: bool
    space: int
    halted: bool = False
    gprs: dict[int, int] = field(default_factory=dict, compare=False, hash=False)
    special: dict[str, int] = field(default_factory=dict, compare=False, hash=False)


class StopReason(enum.Enum):
    """Why the walk of one stack ended."""

    END = "end"  # reached the outermost frame (return address 0, RBP 0, or CFI says undefined)
    NO_CFI = "no-cfi"  # no rule could unwind the frame
    READ_FAILED = "read-failed"  # the stack memory could not be read
    LOOP = "loop"  # a frame repeated or the stack pointer did not grow
    DEPTH = "depth"  # the depth cap was reached
    BAD_RETURN = "bad-return"  # a return address outside any plausible code
    # The walk reached the kernel's entry from user space, and the process's user address
    # space is gone (released on exit): nothing beneath to walk, the stack is whole.
    USER_GONE = "user-gone"

    @property
    def whole(self) -> bool:
        """Whether the walk reached the outermost frame there is."""
        return self is StopReason.END or self is StopReason.USER_GONE


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


# The mapping of the machine's firmware (BIOS, option ROMs), as ``qmpprof.guest.firmware`` tells
# it: the whole address range, for code no ELF of the run holds.
FIRMWARE = Mapping("[firmware]", 0, (1 << 64) - 1, kernel=False)


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a stack, as data: names are made from it only when a profile is written.

    ``pc`` is the frame's address (the leaf's RIP, a caller's return address). ``symbol`` is
    None when no symbol covers the address; ``offset`` is ``pc`` minus the symbol's start.
    ``file``/``line`` come from DWARF when the module has it. The functions inlined at a pc are
    frames of their own with ``inlined`` set, innermost first, before the real function's frame.
    ``tail_call``: a function the walk did not find on the stack (it had left by a tail jump),
    put back from the code (unwind/tailcall.py); ``pc`` is then the address after its jump.
    """

    pc: int
    kernel: bool
    symbol: str | None = None
    offset: int = 0
    module: Mapping | None = None
    file: str | None = None
    line: int | None = None
    inlined: bool = False
    tail_call: bool = False

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
        return not self.stop.whole


class Mode(enum.Enum):
    KERNEL = "kernel"
    USER = "user"


@dataclass(frozen=True, slots=True)
class Process:
    """A process as identified in the guest: pid (None when the guest gives none), program name
    (None when no ELF matched) and the address space (its page-table root, which a process
    without a pid is named by: ``space_name`` is the register's, ``cr3`` on x86); and the
    thread that ran, where the guest tells threads apart (Linux: the task's own pid and comm; a
    process's threads are several Process values with one label)."""

    pid: int | None
    program: str | None
    space: int
    tid: int | None = None
    thread: str | None = None
    space_name: str = "space"

    @property
    def label(self) -> str:
        if self.pid is None:
            space = f"{self.space_name}={self.space:#x}"
            return space if self.program is None else f"{self.program} ({space})"
        return f"{self.program or '[unknown]'} (pid {self.pid})"


@dataclass(frozen=True, slots=True)
class Sample:
    """One vCPU's state at one tick, unwound; or, with ``state`` (its letter, "S"), a task off
    CPU at one tick (``cpu`` is then ``NO_CPU``)."""

    time: float  # seconds since the start of the run (wall clock)
    cpu: int
    mode: Mode
    user: bool  # the CPU ran unprivileged code (``mode`` is by address)
    space: int  # the page-table root in use
    stack: Stack
    process: Process | None = None
    state: str | None = None


NO_CPU = 0xFFFF  # the vCPU of an off-CPU sample: none


@dataclass(frozen=True, slots=True)
class TaskView:
    """One task of the guest as one pause found it: its process and thread, its state as the
    guest's kernel reports it (``state``: the letter, "S"; ``state_name``: "sleeping"), the
    vCPU it runs on (None: off CPU), and, off CPU, its stacks (kernel frames then user
    frames, leaf first; None when they could not be read, or on a CPU: the vCPU's sample)."""

    process: Process | None
    state: str
    state_name: str
    cpu: int | None
    stack: Stack | None
