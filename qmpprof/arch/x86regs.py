"""How QEMU 7.2 prints an x86 vCPU's registers, read into the model's ``Registers``: the
monitor's ``info registers`` text and the gdbstub's ``g`` packet.

``info registers`` has two layouts: the 64-bit one QEMU prints while CS is a 64-bit code segment
(``RAX=… RIP=… RFL=…``, ``R8 =`` with a space) and the 32-bit one it prints otherwise (``EAX=…
EIP=… EFL=…``: real mode while SeaBIOS boots, protected mode, compat-mode user code). Lines end
in ``\\r\\n``; every vCPU's block starts with ``CPU#n``.

The ``g`` layout is the QEMU binary's, never the guest's (docs/i386.md): qemu-system-x86_64
sends 608 bytes in its 64-bit layout, for a 32-bit guest too (zero-extended, EFER.LMA clear);
qemu-system-i386 sends 344 bytes in the i386 layout. The reply's length tells them apart. The
stub hides CS.L, so a compatibility-mode process under a 64-bit kernel reads as long mode there.

A vCPU outside long mode gets i386 registers (DWARF numbers of i386), one in long mode x86_64's.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping

from qmpprof.arch.base import core_registers, frame_registers, gdb_reply, per_cpu
from qmpprof.arch.x86 import I386, X86, X86_64
from qmpprof.errors import TransportError
from qmpprof.model import Registers

# `NAME=hex` and `NAME =hex` (QEMU pads two-letter names: "R8 =", "ES =").
_FIELD = re.compile(r"\b([A-Z][A-Z0-9]*) ?=([0-9a-f]+)\b")
# A segment line: selector, base, limit, flags. FS/GS bases are the per-CPU/TLS pointers.
_SEGMENT = re.compile(r"^(FS|GS) =[0-9a-f]+ ([0-9a-f]+) ", re.MULTILINE)
# The interrupt descriptor table's base and limit.
_IDT = re.compile(r"^IDT=\s*([0-9a-f]+)\s+([0-9a-f]+)", re.MULTILINE)

# QEMU 7.2's x86_64 `g` layout (i386-64bit.xml): rax rbx rcx rdx rsi rdi rbp rsp r8..r15 rip (u64),
# eflags cs ss ds es fs gs (u32), fs_base gs_base k_gs_base cr0 cr2 cr3 cr4 cr8 efer (u64); the
# x87/SSE registers that follow are not needed for unwinding.
REGISTER_NAMES: tuple[str, ...] = (
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip",
    "eflags", "cs", "ss", "ds", "es", "fs", "gs",
    "fs_base", "gs_base", "k_gs_base", "cr0", "cr2", "cr3", "cr4", "cr8", "efer",
)  # fmt: skip
_CORE = struct.Struct("<17Q7I9Q")
# qemu-system-i386's layout (i386-32bit.xml): eax ecx edx ebx esp ebp esi edi eip eflags cs ss ds
# es fs gs fs_base gs_base k_gs_base cr0 cr2 cr3 cr4 cr8 efer (u32 each), then x87 and SSE.
I386_REGISTER_NAMES: tuple[str, ...] = (
    "eax", "ecx", "edx", "ebx", "esp", "ebp", "esi", "edi", "eip",
    "eflags", "cs", "ss", "ds", "es", "fs", "gs",
    "fs_base", "gs_base", "k_gs_base", "cr0", "cr2", "cr3", "cr4", "cr8", "efer",
)  # fmt: skip
_I386_CORE = struct.Struct("<25I")
I386_REPLY_SIZE = 344  # bytes of qemu-system-i386's whole `g` reply
_EFER_LMA = 1 << 10


def x86_registers(
    cpu: int,
    named: dict[str, int],
    *,
    cpl: int,
    cr3: int,
    long_mode: bool = True,
    fs_base: int = 0,
    gs_base: int = 0,
    halted: bool = False,
    cr0: int | None = None,
) -> Registers:
    """The model's registers of an x86 vCPU from its general registers by name (``rax``..
    ``r15``, ``rip``, or ``eax``..``eip``; the 64-bit names with 32-bit values outside long
    mode), in the instruction set the vCPU runs: x86_64 in long mode, i386 outside. With
    ``cr0``, ``special["paging"]`` says whether the vCPU translates addresses (CR0.PG; clear in
    real mode and in the firmware's flat protected mode)."""
    isa = X86_64 if long_mode else I386
    gprs = _numbered(isa, named)
    special = {"cpl": cpl, "fs_base": fs_base, "gs_base": gs_base}
    if cr0 is not None:
        special["paging"] = cr0 >> 31 & 1
    return frame_registers(isa, cpu, gprs, user=cpl == 3, space=cr3, special=special, halted=halted)


def _numbered(isa: X86, named: dict[str, int]) -> dict[int, int]:
    """DWARF number -> value; a 64-bit name stands for its 32-bit register outside long mode."""
    out: dict[int, int] = {}
    for number, name in enumerate(isa.names):
        value = named.get(name)
        if value is None and isa is I386:
            value = named.get("r" + name[1:])
        if value is not None:
            out[number] = value & isa.mask
    return out


class X86Formats:
    """The ``RegisterFormats`` of QEMU's x86 targets (qemu-system-x86_64 and -i386)."""

    extra: tuple[str, ...] = ()

    def from_monitor(self, text: str) -> list[Registers]:
        return per_cpu(text, _monitor_block)

    def from_gdb(
        self, cpu: int, payload: bytes, extra: Mapping[str, int] | None = None
    ) -> Registers:
        named = self.gdb_named(payload)
        return x86_registers(
            cpu,
            named,
            cpl=named["cs"] & 3,
            cr3=named["cr3"],
            long_mode=bool(named["efer"] & _EFER_LMA),
            fs_base=named["fs_base"],
            gs_base=named["gs_base"],
            cr0=named["cr0"],
        )

    def gdb_named(self, payload: bytes) -> dict[str, int]:
        """The named registers of a ``g`` reply (hex text), in QEMU's x86_64 layout, or in the
        i386 layout for a reply of qemu-system-i386's size (its names: eax, eip, ...)."""
        raw = gdb_reply(payload)
        if len(raw) == I386_REPLY_SIZE:
            return dict(zip(I386_REGISTER_NAMES, _I386_CORE.unpack_from(raw), strict=True))
        return dict(zip(REGISTER_NAMES, core_registers(raw, _CORE, X86_64.name), strict=True))


def _monitor_block(cpu: int, text: str) -> Registers:
    fields: dict[str, int] = {}
    for name, value in _FIELD.findall(text):
        # The first occurrence wins: later lines repeat names (DPL=) that do not matter here.
        fields.setdefault(name, int(value, 16))
    long_mode = "RAX" in fields
    prefix = "R" if long_mode else "E"
    # The 64-bit names stand for the 32-bit registers too (x86_registers reads them so).
    spelled = {name: prefix + name[1:].upper() for name in (*X86_64.names[:8], "rip")}
    if long_mode:
        spelled.update({f"r{n}": f"R{n}" for n in range(8, 16)})
    named = {name: fields[text] for name, text in spelled.items() if text in fields}
    bases = {name: int(base, 16) for name, base in _SEGMENT.findall(text)}
    try:
        regs = x86_registers(
            cpu,
            named,
            cpl=fields.get("CPL", 0),
            cr3=fields.get("CR3", 0),
            long_mode=long_mode,
            fs_base=bases.get("FS", 0),
            gs_base=bases.get("GS", 0),
            halted=fields.get("HLT", 0) == 1,
            cr0=fields.get("CR0"),
        )
    except TransportError as err:
        raise TransportError(f"CPU#{cpu}: {err} in monitor text") from err
    idt = _IDT.search(text)
    if idt is not None:
        regs.special.update(idt_base=int(idt[1], 16), idt_limit=int(idt[2], 16))
    return regs
