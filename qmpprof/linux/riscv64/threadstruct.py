"""riscv64 Linux's saved registers of a task off CPU (``switch.SwitchLayout``).

``__switch_to`` (arch/riscv/kernel/entry.S, 6.12) stores ra, sp and the callee-saved s0..s11 in
``thread`` (``struct thread_struct``: ra, sp, s[12], then the FPU state and more) of the task it
switches out, not on the stack: the task resumes at that ra (in ``__schedule``, which called
``__switch_to`` through the ``switch_to`` macro), with that sp and s0, the frame pointer, as the
kernel's own unwinder starts on a blocked task (``walk_stackframe``,
arch/riscv/kernel/stacktrace.c: ``fp = task->thread.s[0]; sp = task->thread.sp;
pc = task->thread.ra``). Its user registers are the ``pt_regs`` at the top of its kernel stack
(``task_pt_regs``: nothing above it), ``epc`` then x1..x31 a word each, whose ``status`` has SPP
(bit 8, the privilege the trap came from) clear for user mode; a kernel thread's says
supervisor (``copy_thread``: ``SR_PP | SR_PIE``). Every offset is read from the kernel's BTF
(checked against trixie's 6.12 vmlinux: thread at task_struct + 3088, pt_regs 288 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.linux.btf import Btf
from qmpprof.linux.riscv64.ptregs import SPP, pt_regs
from qmpprof.model import Registers

# thread_struct.s[i]: s0, s1 are x8, x9; s2..s11 are x18..x27 (the psABI's callee-saved)
_S_REGISTERS = (8, 9, *range(18, 28))
_WORD = 8


@dataclass(frozen=True, slots=True)
class ThreadStruct:
    """Byte offsets: ``task_struct.thread`` (from the task) and its ra, sp and s[12] (from it);
    ``pt_regs``' size, ``epc`` and ``status`` (x1..x31 follow ``epc``)."""

    thread: int
    size: int  # what is read: up to the end of s[12]
    ra: int
    sp: int
    s: int
    regs_size: int
    epc: int
    status: int

    @classmethod
    def from_btf(cls, btf: Btf, arch: InstructionSet) -> ThreadStruct:
        """Raises KeyError naming what this kernel's BTF lacks (or says otherwise than
        ``__switch_to`` stores)."""
        regs = btf.find("pt_regs")
        if regs is None:
            raise KeyError("pt_regs")
        s = btf.field("thread_struct.s")
        if btf.array(s.type_id)[1] != len(_S_REGISTERS):
            raise KeyError("thread_struct.s: not s0..s11")
        offsets = pt_regs(btf)
        if offsets is None:
            raise KeyError("pt_regs: not epc then x1..x31")
        return cls(
            thread=btf.offset_of("task_struct.thread"),
            size=s.offset + len(_S_REGISTERS) * _WORD,
            ra=btf.offset_of("thread_struct.ra"),
            sp=btf.offset_of("thread_struct.sp"),
            s=s.offset,
            regs_size=btf.size_of(regs),
            epc=offsets["epc"],
            status=offsets["status"],
        )

    @property
    def saved(self) -> tuple[int, int]:
        return self.thread, self.size

    def describe(self) -> str:
        return f"thread_struct's ra, sp, s0..s11 {self.size} B, pt_regs {self.regs_size} B"

    def stack_pointer(self, saved: bytes) -> int:
        return _word(saved, self.sp)

    def kernel_registers(
        self, saved: bytes, stack: bytes, sp: int, arch: InstructionSet
    ) -> Registers | None:
        """``thread``'s ra (the pc), sp and s0..s11 (s0 the frame pointer); ``stack`` adds
        nothing."""
        if len(saved) < self.size:
            return None
        pc = arch.return_address(_word(saved, self.ra))
        if pc is None or pc < arch.shared_from:
            return None
        gprs = {n: _word(saved, self.s + _WORD * i) for i, n in enumerate(_S_REGISTERS)}
        gprs |= {arch.sp: sp, arch.pc: pc}
        return Registers(0, arch.name, pc, sp, gprs[arch.fp], False, 0, gprs=gprs)

    def user_registers(self, top: bytes, arch: InstructionSet) -> Registers | None:
        base = len(top) - self.regs_size
        if base < 0 or _word(top, base + self.status) & SPP:
            return None
        pc = _word(top, base + self.epc)
        gprs = {n: _word(top, base + self.epc + _WORD * n) for n in range(1, 32)}
        sp = gprs[arch.sp]
        if pc >= arch.shared_from or sp >= arch.shared_from:
            return None
        gprs |= {0: 0, arch.pc: pc}
        return Registers(0, arch.name, pc, sp, gprs[arch.fp], True, 0, gprs=gprs)


def _word(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset : offset + _WORD], "little")
