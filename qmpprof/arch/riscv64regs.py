"""How qemu-system-riscv64 prints a riscv64 vCPU's registers, read into the model's
``Registers``: the monitor's ``info registers`` text and the gdbstub's ``g`` packet.

``info registers`` (QEMU 7.2, ``-M virt``) prints per vCPU a ``CPU#n`` line, then one CSR a line
(`` pc       ffffffff80a81240``, ``mstatus``, ``stvec``, ``sepc``, ``scause``, ``sscratch``,
``satp`` ...), then ``x0/zero``..``x31/t6`` four to a line and the FP registers. Lines end in
``\\r\\n``. It does not print the privilege mode the vCPU runs in.

The ``g`` packet is the gdbstub's riscv-64bit-cpu.xml layout: x0..x31 and pc as u64, 264 bytes.
The CSRs come one by one (``p``), at the numbers riscv-csr.xml gives them; the privilege mode is
the ``priv`` register of riscv-64bit-virtual.xml (0 user, 1 supervisor, 3 machine), numbered by
its place in the target description (65 on QEMU 7.2). ``EXTRA`` are read with each ``g``.

With ``priv`` a vCPU runs user code when it is 0, and one in M-mode (3: the firmware, OpenSBI,
run at physical addresses) translates no instruction address: ``special["paging"]`` 0, as x86's
CR0.PG clear, which makes it a firmware sample; entered from user mode (mstatus.MPP 0), the
user pc it was entered at (mepc) is ``special["user_pc"]``. Without it (the monitor's text) a
vCPU counts as running user code when its pc is in the lower half (Linux maps no kernel code
there), and one in M-mode counts as user code too.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping

from qmpprof.arch.base import core_registers, frame_registers, gdb_reply, per_cpu
from qmpprof.arch.riscv64 import RISCV64
from qmpprof.errors import TransportError
from qmpprof.model import Registers

_GPR = re.compile(r"\bx(\d+)/\w+\s+([0-9a-f]{16})\b")
_CSR = re.compile(r"^\s*([a-z][a-z0-9]*)\s+([0-9a-f]{16})\s*$", re.MULTILINE)
_CORE = struct.Struct("<33Q")  # x0..x31, pc
_KEPT = ("satp", "sscratch", "sepc", "scause", "stvec", "mstatus", "sstatus")
_PPN = (1 << 44) - 1  # satp's root page number, bits 43..0 (RV64)
USER, MACHINE = 0, 3  # priv: the privilege modes (privileged ISA 1.2)
# Read with each g: the privilege mode, what the firmware was entered from (mstatus.MPP, mepc)
# for a vCPU in M-mode, and sscratch, where Linux keeps the current task while a vCPU runs user
# code (one round trip less for each user-mode sample than asking for it after).
EXTRA = ("priv", "mstatus", "mepc", "sscratch")


def riscv64_registers(cpu: int, gprs: dict[int, int], special: dict[str, int]) -> Registers:
    """The model's registers of a riscv64 vCPU from its registers by DWARF number (the pc at
    ``RISCV64.pc``) and the CSRs read with them (``satp`` gives the page-table root, ``priv``
    the mode)."""
    priv = special.get("priv")
    if priv is None:
        # frame_registers rejects a missing pc: the 0 only lets this line run before it does.
        user = gprs.get(RISCV64.pc, 0) < RISCV64.kernel_boundary
    else:
        user = priv == USER
        if priv == MACHINE:
            special = {**special, "paging": 0}
            if "mepc" in special and (special.get("mstatus", -1) >> 11) & 3 == USER:
                special["user_pc"] = special["mepc"]  # entered from user code (MPP), there
    space = (special.get("satp", 0) & _PPN) << 12
    return frame_registers(RISCV64, cpu, gprs, user=user, space=space, special=special)


class RiscV64Formats:
    """The ``RegisterFormats`` of qemu-system-riscv64."""

    extra: tuple[str, ...] = EXTRA

    def from_monitor(self, text: str) -> list[Registers]:
        return per_cpu(text, _monitor_block)

    def from_gdb(
        self, cpu: int, payload: bytes, extra: Mapping[str, int] | None = None
    ) -> Registers:
        *words, pc = core_registers(gdb_reply(payload), _CORE, RISCV64.name)
        gprs = dict(enumerate(words))
        gprs[RISCV64.pc] = pc
        return riscv64_registers(cpu, gprs, dict(extra or {}))


def _monitor_block(cpu: int, text: str) -> Registers:
    gprs = {int(number): int(value, 16) for number, value in _GPR.findall(text)}
    csrs = {name: int(value, 16) for name, value in _CSR.findall(text)}
    if "pc" in csrs:
        gprs[RISCV64.pc] = csrs["pc"]
    try:
        return riscv64_registers(cpu, gprs, {k: v for k, v in csrs.items() if k in _KEPT})
    except TransportError as err:
        raise TransportError(f"CPU#{cpu}: {err} in monitor text") from err
