"""Kernel memory read whatever mode the vCPUs are in: through the vCPUs first, then what none of
them mapped (each in user mode, where arm64's KPTI unmaps the kernel) physically, through the
kernel's linear map (its slab: tasks, their lists, page tables; the image) and, for the rest
(vmalloc'd memory: task stacks), through the kernel's own page tables.

The kernel's top-level table is ``init_mm.pgd`` (``swapper_pg_dir``, in the image), ``init_mm``
from kallsyms (not where they name no data: bookworm's arm64 6.1). It translates the kernel's
half as a process's table translates the user half, with the same number of levels (Linux
gives both halves one size: T0SZ = T1SZ), the address taken below that size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.linearmap import LinearMap, linear_reader
from qmpprof.linux.running.pagetables import PageTables
from qmpprof.memory import Reader, kernel_reader, read_ints
from qmpprof.transport.base import GuestTransport

_PAGE = 4096


@dataclass(frozen=True, slots=True)
class KernelTables:
    """How processes' tables are walked (levels, entries, the linear map) and the kernel's
    top-level table (a kernel address)."""

    tables: PageTables
    root: int


async def kernel_root(read: Reader, kernel: LinuxKernel, slide: int, pgd: int) -> int | None:
    """``init_mm.pgd`` in the running kernel (``pgd``: ``mm_struct.pgd``'s offset); None when
    kallsyms do not name ``init_mm`` (bookworm's arm64 6.1: the initial task's ``active_mm``
    is whichever process's it last borrowed, not ``init_mm``) or it does not read."""
    init_mm = kernel.address("init_mm", slide)
    if init_mm is None:
        return None
    (root,) = await read_ints(read, [(init_mm + pgd, 8)])
    return root or None


def beyond_user_mode(
    transport: GuestTransport,
    cpus: Sequence[int],
    linear: LinearMap | None,
    kernel: KernelTables | None = None,
) -> Reader:
    """Kernel memory through ``cpus`` in turn, then what none of them could read physically
    through ``linear`` and ``kernel``'s tables, when known."""
    through_cpus = kernel_reader(transport, cpus)
    if linear is None:
        return through_cpus
    physical = linear_reader(transport, linear, cpus[0])
    walk = None
    if kernel is not None:
        known = kernel.tables
        walk = known.over(physical)

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        found = await through_cpus(ranges)
        missing = [i for i, (_, size) in enumerate(ranges) if found[i] is None and size > 0]
        linear_ones = [i for i in missing if linear.physical(*ranges[i]) is not None]
        if linear_ones:
            again = await physical([ranges[i] for i in linear_ones])
            for i, data in zip(linear_ones, again, strict=True):
                found[i] = data
        if walk is not None and kernel is not None:
            for i in missing:
                if i not in linear_ones:
                    found[i] = await _through_tables(walk, kernel.root, *ranges[i])
        return found

    return read


async def _through_tables(walk: PageTables, root: int, addr: int, size: int) -> bytes | None:
    """[addr, addr + size) translated page by page through the table at ``root``, read in the
    linear map; None when a page is not mapped."""
    size_mask = walk.span - 1
    pieces = []
    at, end = addr, addr + size
    while at < end:
        stop = min(end, (at // _PAGE + 1) * _PAGE)
        place = await walk.physical(root, at & size_mask)
        if place is None:
            return None
        pieces.append((walk.direct_map + place, stop - at))
        at = stop
    found = await walk.read(pieces)
    if any(part is None for part in found):
        return None
    return b"".join(part or b"" for part in found)
