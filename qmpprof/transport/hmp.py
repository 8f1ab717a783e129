"""Pure code of QEMU's human monitor (HMP) memory dumps, ``x/N<u>x``: the command and its text.

No I/O here: the QMP transport sends ``human-monitor-command`` and hands the reply text over.
(``info registers`` text is the target's: ``qmpprof.arch`` reads it.)
"""

from __future__ import annotations

import contextlib
import re

from qmpprof.errors import MemoryReadError, TransportError

_X_LINE = re.compile(r"^([0-9a-f]+):((?: 0x[0-9a-f]+)+)\s*$")
_CANNOT = "Cannot access memory"


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


def parse_gva2gpa(text: str) -> int | None:
    """The physical address of a ``gva2gpa`` reply, None for "Unmapped"; TransportError for
    anything else."""
    reply = text.strip()
    if reply.startswith("gpa: "):
        with contextlib.suppress(ValueError):
            return int(reply[5:], 16)
    if reply == "Unmapped":
        return None
    raise TransportError(f"unexpected monitor 'gva2gpa' output: {reply[:80]!r}")
