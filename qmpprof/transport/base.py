"""The seam between the sampler and QEMU: what any transport (QMP, gdbstub, a test fake) offers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from qmpprof.errors import MemoryReadError
from qmpprof.model import Registers


class GuestTransport(Protocol):
    """An open connection to one QEMU guest.

    Errors: ``GuestGoneError`` when QEMU went away, ``TransportError`` for a refused command,
    ``MemoryReadError`` when guest memory is not mapped.
    """

    async def is_running(self) -> bool:
        """True when the guest is running (QMP ``query-status``), False when paused."""
        ...

    async def stop(self) -> None: ...

    async def cont(self) -> None: ...

    async def cpus(self) -> list[int]:
        """Indexes of the guest's vCPUs."""
        ...

    async def registers(self, cpu: int) -> Registers: ...

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        """Those of ``cpu``'s system registers ``names`` (as QEMU's gdbstub names them:
        ``TCR_EL1``) the transport can read, by name; the guest is left in the run state it
        had. QMP's monitor prints none of them."""
        ...

    async def read(self, cpu: int, addr: int, size: int) -> bytes:
        """Read guest-virtual memory as seen by ``cpu`` (its current page tables).

        ``addr`` is an unsigned 64-bit address; the read may span pages only if all are mapped.
        """
        ...

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        """Several ranges as ``cpu`` sees memory, in as few round trips as the transport can
        (a gdbstub: one): each range's bytes, or the MemoryReadError saying it is unmapped
        (with the bytes before the first unmapped page, ``readable``). Other errors raise."""
        ...

    async def read_physical(
        self, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        """Several ranges of guest-physical memory (no vCPU's translation), as ``read_many``
        returns them."""
        ...

    async def translate(self, cpu: int, addr: int) -> int | None:
        """The guest-physical address ``cpu``'s translation gives ``addr`` now (None: not
        mapped there). TransportError when the transport cannot ask (a gdbstub alone)."""
        ...

    @property
    def control(self) -> GuestTransport | None:
        """A channel that reads memory and registers while the guest runs, without stopping it
        (QMP's memsave and monitor), for what a guest OS learns between ticks; None when the
        transport has none (a gdbstub alone)."""
        ...

    async def close(self) -> None: ...
