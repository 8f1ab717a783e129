"""How qemu-system-aarch64 prints an aarch64 vCPU's registers, read into the model's
``Registers``: the monitor's ``info registers`` text and the gdbstub's ``g`` packet.

``info registers`` (QEMU 7.2, ``-cpu max``) prints per vCPU a ``CPU#n`` line, then ``PC=``,
``X00=``..``X30=``, ``SP=`` and ``PSTATE=`` followed by the flags and the exception level with
its stack pointer choice (``EL1h``, ``EL0t``), then the FP/SVE registers, which the walk does not
need. Lines end in ``\\r\\n``. The page-table roots (TTBR0/1_EL1) and TCR_EL1 are not printed.

The ``g`` packet is the gdbstub's aarch64-core.xml layout: x0..x30, sp, pc as u64 and cpsr as
u32, 268 bytes. The system registers (TCR_EL1 among them) come one by one (``p``), at the numbers
the stub's system-registers.xml gives them.

A vCPU at EL0 runs user code; EL1 (or EL2 under VHE) the kernel.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.base import core_registers, frame_registers, gdb_reply, per_cpu
from qmpprof.errors import TransportError
from qmpprof.model import Registers

_FIELD = re.compile(r"\b(PC|SP|X\d\d|PSTATE)=([0-9a-f]+)\b")
_EL = re.compile(r"\bEL([0-3])[th]\b")
_CORE = struct.Struct("<33QI")  # x0..x30, sp, pc; cpsr
REGISTER_NAMES: tuple[str, ...] = (*AARCH64.names, "cpsr")


def aarch64_registers(cpu: int, gprs: dict[int, int], pstate: int) -> Registers:
    """The model's registers of an aarch64 vCPU from its registers by DWARF number and its
    PSTATE (CPSR), whose bits 3..2 are the exception level."""
    el = (pstate >> 2) & 3
    return frame_registers(
        AARCH64, cpu, gprs, user=el == 0, space=0, special={"el": el, "pstate": pstate}
    )


class AArch64Formats:
    """The ``RegisterFormats`` of qemu-system-aarch64."""

    extra: tuple[str, ...] = ()

    def from_monitor(self, text: str) -> list[Registers]:
        return per_cpu(text, _monitor_block)

    def from_gdb(
        self, cpu: int, payload: bytes, extra: Mapping[str, int] | None = None
    ) -> Registers:
        *words, cpsr = core_registers(gdb_reply(payload), _CORE, AARCH64.name)
        return aarch64_registers(cpu, dict(enumerate(words)), cpsr)


def _monitor_block(cpu: int, text: str) -> Registers:
    fields: dict[str, int] = {}
    for name, value in _FIELD.findall(text):
        fields.setdefault(name, int(value, 16))
    gprs = {int(name[1:]): value for name, value in fields.items() if name[0] == "X"}
    for number, name in ((AARCH64.sp, "SP"), (AARCH64.pc, "PC")):
        if name in fields:
            gprs[number] = fields[name]
    pstate = fields.get("PSTATE")
    try:
        if pstate is None:
            raise TransportError("register PSTATE missing")
        regs = aarch64_registers(cpu, gprs, pstate)
    except TransportError as err:
        raise TransportError(f"CPU#{cpu}: {err} in monitor text") from err
    el = _EL.search(text)
    if el is not None and int(el[1]) != regs.special["el"]:
        raise TransportError(f"CPU#{cpu}: PSTATE and EL{el[1]} disagree in monitor text")
    return regs
