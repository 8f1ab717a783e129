"""x86_64 Linux's saved registers of a task off CPU (``switch.SwitchLayout``).

``__switch_to_asm`` pushes an ``inactive_task_frame`` (the callee-saved registers, the frame
pointer, the return address into the scheduler) and stores the stack pointer in ``thread.sp``:
the task resumes at that return address with its stack above the frame, as the kernel's own ORC
unwinder starts on a blocked task (``__unwind_start``). Its user registers are the ``pt_regs``
at the top of its kernel stack, whose code and stack segments are user ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.linux.btf import Btf
from qmpprof.model import Registers

# What lies above pt_regs at the top of a kernel stack (TOP_OF_KERNEL_STACK_PADDING, x86_64):
# nothing, or 16 bytes on kernels built with CONFIG_X86_FRED (6.9 and later); the pt_regs whose
# code and stack segments are user ones (privilege level 3) is taken.
STACK_PADDINGS = (0, 16)


@dataclass(frozen=True, slots=True)
class InactiveTaskFrame:
    """Byte offsets: ``task_struct.thread.sp``, ``inactive_task_frame``'s, ``pt_regs``'."""

    thread_sp: int
    frame_size: int
    frame_bp: int
    frame_ret: int
    regs_size: int  # struct pt_regs
    regs: tuple[tuple[str, int], ...]  # registers in pt_regs: the instruction set's name, offset

    @classmethod
    def from_btf(cls, btf: Btf, arch: InstructionSet) -> InactiveTaskFrame:
        """Raises KeyError naming what this kernel's BTF lacks. ``pt_regs`` names x86_64's
        registers without their "r" ("ip", "bx"; but "r8"), its segments "cs" and "ss"."""
        frame = btf.find("inactive_task_frame")
        regs = btf.find("pt_regs")
        if frame is None or regs is None:
            raise KeyError("inactive_task_frame or pt_regs")
        return cls(
            thread_sp=btf.offset_of("task_struct.thread") + btf.offset_of("thread_struct.sp"),
            frame_size=btf.size_of(frame),
            frame_bp=btf.offset_of("inactive_task_frame.bp"),
            frame_ret=btf.offset_of("inactive_task_frame.ret_addr"),
            regs_size=btf.size_of(regs),
            regs=tuple(_pt_regs(btf, (*arch.names, "cs", "ss"))),
        )

    @property
    def saved(self) -> tuple[int, int]:
        return self.thread_sp, 8

    def describe(self) -> str:
        return f"inactive_task_frame {self.frame_size} B, pt_regs {self.regs_size} B"

    def stack_pointer(self, saved: bytes) -> int:
        return int.from_bytes(saved, "little")

    def kernel_registers(
        self, saved: bytes, stack: bytes, sp: int, arch: InstructionSet
    ) -> Registers | None:
        """The return address the context switch pushed, the frame pointer it saved, the
        stack above the frame."""
        if len(stack) < self.frame_size:
            return None
        ret = int.from_bytes(stack[self.frame_ret : self.frame_ret + 8], "little")
        bp = int.from_bytes(stack[self.frame_bp : self.frame_bp + 8], "little")
        if ret < arch.shared_from:
            return None
        return Registers(0, arch.name, ret, sp + self.frame_size, bp, False, 0)

    def user_registers(self, top: bytes, arch: InstructionSet) -> Registers | None:
        offsets = dict(self.regs)
        for pad in STACK_PADDINGS:
            base = len(top) - pad - self.regs_size
            if base < 0:
                continue

            def value(name: str, base: int = base) -> int:
                offset = base + offsets[name]
                return int.from_bytes(top[offset : offset + 8], "little")

            if value("cs") & 3 == 3 and value("ss") & 3 == 3:
                gprs = {n: value(name) for n, name in enumerate(arch.names) if name in offsets}
                pc, sp, fp = gprs.get(arch.pc, 0), gprs.get(arch.sp, 0), gprs.get(arch.fp, 0)
                return Registers(0, arch.name, pc, sp, fp, True, 0, gprs=gprs)
        return None


def _pt_regs(btf: Btf, names: Sequence[str]) -> list[tuple[str, int]]:
    out = []
    for name in names:
        for member in (name, name[1:]):
            try:
                out.append((name, btf.offset_of(f"pt_regs.{member}")))
                break
            except KeyError:
                continue
    found = {name for name, _ in out}
    if not {"cs", "ss"} <= found:
        raise KeyError("pt_regs.cs, pt_regs.ss")
    return out
