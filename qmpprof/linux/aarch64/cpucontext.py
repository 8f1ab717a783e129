"""arm64 Linux's saved registers of a task off CPU (``switch.SwitchLayout``).

``cpu_switch_to`` (arch/arm64/kernel/entry.S) stores the callee-saved x19..x28, the frame
pointer x29, sp and its return address (lr: into ``__switch_to``, which the scheduler called) in
``thread.cpu_context`` (``struct cpu_context``: x19 .. x28, fp, sp, pc) of the task it switches
out, not on the stack: the task resumes at that pc, with that sp and fp, as the kernel's own
unwinder starts on a blocked task (``thread_saved_pc``, ``thread_saved_fp``). The return address
is stripped of any pointer-authentication code as every other. Its user registers are the
``pt_regs`` at the top of its kernel stack (nothing above it on arm64), whose ``pstate`` says
EL0 with the 64-bit instruction set (M[4:0] all clear: EL0t).
"""

from __future__ import annotations

from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.linux.btf import Btf
from qmpprof.model import Registers

_MODE = 0x1F  # pstate's M[4:0]: 0 is EL0t in AArch64 (bit 4 set: a 32-bit task)
_CALLEE_SAVED = tuple(f"x{n}" for n in range(19, 29))
_GPRS = 31  # pt_regs.regs: x0..x30


@dataclass(frozen=True, slots=True)
class CpuContext:
    """Byte offsets: ``task_struct.thread.cpu_context`` and its members (from it), and
    ``pt_regs``'."""

    context: int
    size: int
    registers: tuple[tuple[int, int], ...]  # x19..x28: DWARF number, offset in cpu_context
    fp: int
    sp: int
    pc: int
    regs_size: int  # struct pt_regs
    regs: int  # pt_regs.regs, x0..x30
    regs_sp: int
    regs_pc: int
    pstate: int

    @classmethod
    def from_btf(cls, btf: Btf, arch: InstructionSet) -> CpuContext:
        """Raises KeyError naming what this kernel's BTF lacks."""
        context = btf.find("cpu_context")
        regs = btf.find("pt_regs")
        if context is None or regs is None:
            raise KeyError("cpu_context or pt_regs")
        return cls(
            context=btf.offset_of("task_struct.thread")
            + btf.offset_of("thread_struct.cpu_context"),
            size=btf.size_of(context),
            registers=tuple(
                (arch.names.index(name), btf.offset_of(f"cpu_context.{name}"))
                for name in _CALLEE_SAVED
            ),
            fp=btf.offset_of("cpu_context.fp"),
            sp=btf.offset_of("cpu_context.sp"),
            pc=btf.offset_of("cpu_context.pc"),
            regs_size=btf.size_of(regs),
            regs=btf.offset_of("pt_regs.regs"),
            regs_sp=btf.offset_of("pt_regs.sp"),
            regs_pc=btf.offset_of("pt_regs.pc"),
            pstate=btf.offset_of("pt_regs.pstate"),
        )

    @property
    def saved(self) -> tuple[int, int]:
        return self.context, self.size

    def describe(self) -> str:
        return f"cpu_context {self.size} B, pt_regs {self.regs_size} B"

    def stack_pointer(self, saved: bytes) -> int:
        return _word(saved, self.sp)

    def kernel_registers(
        self, saved: bytes, stack: bytes, sp: int, arch: InstructionSet
    ) -> Registers | None:
        """``cpu_context``'s pc, sp and fp (and x19..x28); ``stack`` adds nothing."""
        if len(saved) < self.size:
            return None
        pc = arch.return_address(_word(saved, self.pc))
        if pc is None or pc < arch.shared_from:
            return None
        fp = _word(saved, self.fp)
        gprs = {number: _word(saved, offset) for number, offset in self.registers}
        gprs |= {arch.fp: fp, arch.sp: sp, arch.pc: pc}
        return Registers(0, arch.name, pc, sp, fp, False, 0, gprs=gprs)

    def user_registers(self, top: bytes, arch: InstructionSet) -> Registers | None:
        base = len(top) - self.regs_size
        if base < 0 or _word(top, base + self.pstate) & _MODE:
            return None
        pc, sp = _word(top, base + self.regs_pc), _word(top, base + self.regs_sp)
        if pc >= arch.shared_from or sp >= arch.shared_from:
            return None
        gprs = {n: _word(top, base + self.regs + 8 * n) for n in range(_GPRS)}
        gprs |= {arch.sp: sp, arch.pc: pc}
        return Registers(0, arch.name, pc, sp, gprs[arch.fp], True, 0, gprs=gprs)


def _word(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset : offset + 8], "little")
