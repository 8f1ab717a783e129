"""Pure parsers of QEMU's human monitor (HMP) text: ``info registers`` and ``x/N<u>x``.

No I/O here: the QMP transport sends ``human-monitor-command`` and hands the reply text over.
Both layouts of ``info registers`` are understood: the 64-bit one QEMU prints while CS is a
64-bit code segment (``RAX=… RIP=… RFL=…``, ``R8 =`` with a space) and the 32-bit one it prints
otherwise (``EAX=… EIP=… EFL=…``: real mode while SeaBIOS boots, protected mode, compat-mode
user code). Lines end in ``\\r\\n``; every vCPU's block starts with ``CPU#n``.
"""

from __future__ import annotations

import re

from qmpprof.errors import MemoryReadError, TransportError
from qmpprof.model import DWARF_REGS, Registers

# `NAME=hex` and `NAME =hex` (QEMU pads two-letter names: "R8 =", "ES =").
_FIELD = re.compile(r"\b([A-Z][A-Z0-9]*) ?=([0-9a-f]+)\b")
# A segment line: selector, base, limit, flags. FS/GS bases are the per-CPU/TLS pointers.
_SEGMENT = re.compile(r"^(FS|GS) =[0-9a-f]+ ([0-9a-f]+) ", re.MULTILINE)
_CPU = re.compile(r"^CPU#(\d+)", re.MULTILINE)
_X_LINE = re.compile(r"^([0-9a-f]+):((?: 0x[0-9a-f]+)+)\s*$")
_CANNOT = "Cannot access memory"


def parse_registers(text: str) -> Registers:
    """The registers of the one vCPU in ``text`` (the reply to ``info registers``)."""
    blocks = parse_all_registers(text)
    if len(blocks) != 1:
        raise TransportError(f"expected one CPU in 'info registers' output, found {len(blocks)}")
    return blocks[0]


def parse_all_registers(text: str) -> list[Registers]:
    """Every vCPU's registers from ``info registers -a`` (one ``CPU#n`` block each)."""
    starts = list(_CPU.finditer(text))
    if not starts:
        raise TransportError(f"not 'info registers' output: {text.strip()[:60]!r}")
    blocks = []
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        blocks.append(_parse_block(int(match.group(1)), text[match.end() : end]))
    return blocks


def _parse_block(cpu: int, text: str) -> Registers:
    fields: dict[str, int] = {}
    for name, value in _FIELD.findall(text):
        # The first occurrence wins: later lines repeat names (DPL=) that do not matter here.
        fields.setdefault(name, int(value, 16))
    long_mode = "RAX" in fields
    prefix = "R" if long_mode else "E"
    try:
        gprs = {i: fields[_name(reg, prefix)] for i, reg in enumerate(DWARF_REGS) if i < 8}
        gprs[16] = fields[prefix + "IP"]
    except KeyError as err:
        raise TransportError(f"CPU#{cpu}: register {err.args[0]} missing in monitor text") from err
    if long_mode:
        gprs.update({n: fields[f"R{n}"] for n in range(8, 16) if f"R{n}" in fields})
    bases = {name: int(base, 16) for name, base in _SEGMENT.findall(text)}
    return Registers(
        cpu=cpu,
        rip=gprs[16],
        rsp=gprs[7],
        rbp=gprs[6],
        cpl=fields.get("CPL", 0),
        cr3=fields.get("CR3", 0),
        fs_base=bases.get("FS", 0),
        gs_base=bases.get("GS", 0),
        long_mode=long_mode,
        halted=fields.get("HLT", 0) == 1,
        gprs=gprs,
    )


def _name(dwarf_name: str, prefix: str) -> str:
    # DWARF_REGS spells the 64-bit names ("rax"); the 32-bit layout prints EAX.
    return prefix + dwarf_name[1:].upper()


def x_command(addr: int, size: int) -> str:
    """The HMP command reading ``size`` bytes at ``addr``: quad words, bytes for a ragged size."""
    if size % 8 == 0:
        return f"x/{size // 8}gx {addr:#x}"
    return f"x/{size}bx {addr:#x}"


def parse_x(text: str, addr: int, size: int) -> bytes:
    """The bytes of an ``x`` reply; ``Cannot access memory`` (a *successful* reply) raises
    MemoryReadError, as does a reply shorter than asked for."""
    unit = 8 if size % 8 == 0 else 1
    out = bytearray()
    for line in text.splitlines():
        if not line.strip():
            continue
        if _CANNOT in line:
            raise MemoryReadError(addr, size, line.strip())
        match = _X_LINE.match(line)
        if match is None:
            raise TransportError(f"unexpected line in monitor 'x' output: {line.strip()[:80]!r}")
        for value in match.group(2).split():
            out += int(value, 16).to_bytes(unit, "little")
    if len(out) < size:
        raise MemoryReadError(addr, size, f"monitor returned {len(out)} bytes")
    return bytes(out[:size])
