"""The monitor's ``info registers`` text read the simple way, as a witness independent of
qmpprof's own parser (qmpprof/arch/x86regs.py)."""

from __future__ import annotations

import re


def monitor_fields(text: str) -> dict[str, int]:
    """NAME=hex fields of `info registers`, first occurrence wins (the witness's own parser)."""
    fields: dict[str, int] = {}
    for name, value in re.findall(r"\b([A-Z][A-Z0-9]*) ?=([0-9a-f]+)\b", text):
        fields.setdefault(name, int(value, 16))
    return fields
