"""How qmpprof talks to QEMU: the GuestTransport seam and its implementations."""

from __future__ import annotations

from qmpprof.transport.base import GuestTransport

__all__ = ["GuestTransport"]
