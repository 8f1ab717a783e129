"""Where a Linux task off CPU keeps its registers, as its instruction set's kernel leaves them:
the registers its context switch saved (where its kernel stack resumes) and the user registers
it entered the kernel with (the ``pt_regs`` at the top of its kernel stack).

Each instruction set's Linux saves them its own way, described by the kernel's BTF: x86_64's
``inactive_task_frame`` on the stack at ``thread.sp`` (``linux.x86_64.taskframe``), arm64's
``thread.cpu_context`` in the task itself (``linux.aarch64.cpucontext``), riscv64's ``thread``'s
ra, sp and s0..s11 (``linux.riscv64.threadstruct``): the instruction set's platform says which
(``platform.LinuxPlatform.switch_layout``).
"""

from __future__ import annotations

from typing import Protocol

from qmpprof.arch.base import InstructionSet
from qmpprof.model import Registers


class SwitchLayout(Protocol):
    """One instruction set's saved registers of a task off CPU, at BTF's offsets."""

    @property
    def saved(self) -> tuple[int, int]:
        """Where in ``task_struct`` the context switch left what is read of each task: offset,
        size."""
        ...

    def describe(self) -> str:
        """What is read, in a few words: the structures' names and sizes."""
        ...

    def stack_pointer(self, saved: bytes) -> int:
        """The kernel stack pointer the task was switched out with (``saved``: those bytes);
        its stack is read from there to its end."""
        ...

    def kernel_registers(
        self, saved: bytes, stack: bytes, sp: int, arch: InstructionSet
    ) -> Registers | None:
        """Where the task resumes in the kernel, from ``saved`` and its kernel ``stack`` from
        ``sp`` up; None when that is no kernel code."""
        ...

    def user_registers(self, top: bytes, arch: InstructionSet) -> Registers | None:
        """The user registers the task entered the kernel with, from the ``pt_regs`` at the
        top of its kernel stack (``top``: the stack's last bytes, up to its end); None when
        they are no user mode's."""
        ...
