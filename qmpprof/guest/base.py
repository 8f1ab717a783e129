"""The guest OS seam: who runs on a vCPU, and in which address space to unwind and name it.

One implementation per way a guest lets us know: the Emerald metadata page (``emerald.py``),
page-table roots alone (``cr3.py``); a Linux guest will read its task_struct. The sampler calls
``reads_for`` before it reads the stack (those ranges go out in the same round trip) and
``identify`` while the guest is stopped; ``identify`` may read guest memory through the sample's
page cache and the transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from qmpprof.memory import fetch
from qmpprof.model import Process, Registers
from qmpprof.pages import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import AddressSpace

Space_co = TypeVar("Space_co", covariant=True)


class Identified(Protocol[Space_co]):
    """Who was running on a vCPU: the process (None for the kernel itself) and the address
    space (modules, unwinding steps, symbols) to unwind and name its stack with."""

    @property
    def process(self) -> Process | None: ...

    @property
    def space(self) -> Space_co: ...


@dataclass(frozen=True, slots=True)
class Identity:
    """What the identifiers of this package answer."""

    process: Process | None
    space: AddressSpace


class GuestIdentifier(Protocol[Space_co]):
    """Tells who runs on a vCPU; everything learnt is cached across samples. Generic in the
    address space so that unit tests can give the sampler spaces of their own."""

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        """(address, size) ranges ``identify`` will need for this sample, read together with
        the stack window."""
        ...

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identified[Space_co]: ...


async def read_range(transport: GuestTransport, cpu: int, addr: int, size: int) -> bytes | None:
    """Bytes of a guest range, or None if any of it is unmapped (not yet faulted in, say)."""
    if size == 0:
        return None
    cache = PageCache()
    await fetch(transport, cache, cpu, addr, size)
    return cache.read(addr, size)
