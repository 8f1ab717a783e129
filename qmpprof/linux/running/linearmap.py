"""Kernel memory that a vCPU in user mode cannot see, read physically through the kernel's
linear map.

A kernel that unmaps itself from user mode (arm64's CONFIG_UNMAP_KERNEL_AT_EL0, on in bookworm's
6.1 and 6.12 under ``-cpu max``; x86's PTI) leaves a user-mode vCPU with page tables in which
a task's task_struct, its mm and its VMAs are not there: QEMU reads memory through the vCPU's
current translation, so a user-mode sample's task reads as unmapped. Those structures are the
kernel's slab and per-CPU memory, which lives in the linear map (all of RAM at one offset from
its physical address: arm64's PAGE_OFFSET region, x86_64's direct map), below the kernel image's
own addresses. The offset is measured at attach, as QEMU translates (``GuestTransport.translate``)
each vCPU's current-task slot (per-CPU memory) through a vCPU in kernel mode: the slots must
agree on one offset. In a user-mode sample whose task reads as unmapped, ``linear_reader`` reads
addresses of that region physically, user addresses still through the vCPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from qmpprof.errors import TransportError
from qmpprof.memory import Reader, reader
from qmpprof.transport.base import GuestTransport

_TRIES = 20  # passes over the vCPUs until one in kernel mode translates the slots
_PAUSE = 0.05  # seconds between two passes


@dataclass(frozen=True, slots=True)
class LinearMap:
    """Kernel addresses in [start, end) are ``offset`` above their physical address; those of
    the kernel image, in ``image`` [start, end), its ``offset`` above theirs (an image is
    loaded in one piece of physical memory: arm64's, read at the image's start)."""

    start: int
    end: int
    offset: int
    image: tuple[int, int, int] | None = None

    def physical(self, addr: int, size: int) -> int | None:
        """Where [addr, addr + size) is in physical memory, None if not in either region."""
        if self.start <= addr and addr + size <= self.end:
            return addr - self.offset
        if self.image is not None and self.image[0] <= addr and addr + size <= self.image[1]:
            return addr - self.image[2]
        return None


async def find_linear_map(
    control: GuestTransport,
    slots: Sequence[int],
    start: int,
    end: int,
    image: tuple[int, int, int] | None = None,
    tries: int = _TRIES,
    walk: Callable[[int], Awaitable[int | None]] | None = None,
) -> LinearMap | None:
    """The linear map's offset, from ``slots`` (linear addresses: the vCPUs' current-task
    slots) translated through a vCPU in kernel mode, and the ``image``'s (its runtime span and
    an address of it surely mapped: 6.1 does not map its head, before ``_stext``) from that
    address, or by ``walk`` (the platform's ``kernel_walk``) in a pass where no vCPU is in
    kernel mode; None when no vCPU was in kernel mode in ``tries`` passes and there is no
    ``walk``, the transport cannot translate, or the slots disagree."""
    wanted = [slot for slot in slots if start <= slot < end]
    if not wanted:
        return None
    probes = wanted if image is None else [*wanted, image[2]]
    cpus = await control.cpus()
    offsets: dict[int, int] = {}
    try:
        for _ in range(tries):
            in_kernel = False
            for cpu in cpus:
                regs = await control.registers(cpu)
                if regs.user:
                    continue
                in_kernel = True
                for slot in probes:
                    if slot not in offsets:
                        found = await control.translate(cpu, slot)
                        if found is not None:
                            offsets[slot] = slot - found
            if not in_kernel and walk is not None:
                # Where the walk cannot (KPTI leaves EL0 the trampoline's tables alone), a vCPU
                # entering the kernel still can: the passes go on.
                for slot in probes:
                    found = None if slot in offsets else await walk(slot)
                    if found is not None:
                        offsets[slot] = slot - found
            if len(offsets) == len(probes) or tries == 1:
                break
            await asyncio.sleep(_PAUSE)
    except TransportError:
        return None
    linear = {offsets[slot] for slot in wanted if slot in offsets}
    if len(linear) != 1 or len(offsets) != len(probes):
        return None
    placed = None if image is None else (image[0], image[1], offsets[image[2]])
    return LinearMap(start, end, linear.pop(), placed)


def linear_reader(inner: GuestTransport, linear: LinearMap, cpu: int) -> Reader:
    """Memory as a user-mode ``cpu`` would need it: ranges inside ``linear`` read physically,
    the others through the vCPU."""
    through_cpu = reader(inner, cpu)

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        places = [linear.physical(addr, size) if size > 0 else None for addr, size in ranges]
        physical = [i for i, at in enumerate(places) if at is not None]
        out: list[bytes | None] = [None] * len(ranges)
        if physical:
            found = await inner.read_physical([(places[i] or 0, ranges[i][1]) for i in physical])
            for i, got in zip(physical, found, strict=True):
                out[i] = got if isinstance(got, bytes) else None
        virtual = [i for i, at in enumerate(places) if at is None]
        for i, data in zip(virtual, await through_cpu([ranges[i] for i in virtual]), strict=True):
            out[i] = data
        return out

    return read
