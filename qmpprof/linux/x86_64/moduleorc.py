"""A loaded module's ORC tables, read from guest memory: ``struct module``'s
``arch.orc_unwind_ip``/``orc_unwind`` (offsets from the kernel's BTF: ``ModuleLayout.orc``),
sorted when the module was loaded and written as its kernel's are (the kernel image's layout
and register numbering)."""

from __future__ import annotations

from qmpprof.linux.running.modules import ModuleLayout
from qmpprof.linux.x86_64.orctables import OrcTable
from qmpprof.memory import Reader, read_ints

MAX_ORCS = 1 << 22  # entries read of one module at most: more is damage


async def module_orc(
    read: Reader, at: int, layout: ModuleLayout, kernel_orc: OrcTable | None
) -> OrcTable | None:
    """The ORC table of the module whose ``struct module`` is at ``at``; None when it has none
    or it does not read."""
    if layout.orc is None:
        return None
    num_orcs, orc_ip, orc = layout.orc
    count, ips, entries = await read_ints(
        read, [(at + num_orcs, 4), (at + orc_ip, 8), (at + orc, 8)]
    )
    if not count or not ips or not entries or count > MAX_ORCS:
        return None
    ip_bytes, orc_bytes = await read([(ips, 4 * count), (entries, 6 * count)])
    if ip_bytes is None or orc_bytes is None:
        return None
    try:
        if kernel_orc is None:
            return OrcTable.from_sections(ip_bytes, ips, orc_bytes)
        return OrcTable.from_sections(
            ip_bytes, ips, orc_bytes, kernel_orc.layout, regs=kernel_orc.regs
        )
    except ValueError:
        return None
