"""riscv64 Linux's ``struct pt_regs`` as its exception entry stores it (arch/riscv/kernel/
entry.S): ``epc`` in x0's place, then general register n at 8n, then ``status``, whose SPP bit
says the trap came from S-mode; read from the kernel's BTF by the entry's reader (``entry.py``)
and the off-CPU one (``threadstruct.py``)."""

from __future__ import annotations

from qmpprof.linux.btf import Btf

SPP = 1 << 8  # sstatus.SPP: the previous privilege was S-mode
_MEMBERS = ("epc", "ra", "sp", "s0", "t6", "status")
_WORD = 8


def pt_regs(btf: Btf) -> dict[str, int] | None:
    """``struct pt_regs``'s members the walk reads (``epc``, ``ra``, ``sp``, ``s0``, ``t6``,
    ``status``), by BTF; None unless laid out as general register n at 8n (epc in x0's
    place)."""
    try:
        found = {name: btf.offset_of(f"pt_regs.{name}") for name in _MEMBERS}
    except KeyError:
        return None
    base = found["epc"]
    if (found["ra"], found["sp"], found["s0"], found["t6"]) != tuple(
        base + _WORD * n for n in (1, 2, 8, 31)
    ):
        return None
    return found
