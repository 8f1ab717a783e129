"""How qmpprof talks to QEMU: the GuestTransport seam (base.py), its implementations, and this,
their registry. ``--transport auto`` takes the first kind, in registry order, that one of the
addresses given suits (and that QEMU then allows: a kind may fall back on its own); a new
transport is a module of this package and a ``register`` line below."""

from __future__ import annotations

from collections.abc import Callable

import qmpprof.transport.kinds as kinds
from qmpprof.errors import UsageError
from qmpprof.transport.base import (
    AUTO,
    Address,
    BootFiles,
    DomainSet,
    GuestTransport,
    Opened,
    Reach,
    TransportKind,
)
from qmpprof.transport.kinds import quit_qemu

__all__ = [
    "AUTO",
    "BootFiles",
    "DomainSet",
    "GuestTransport",
    "Opened",
    "Reach",
    "TransportKind",
    "boot_files",
    "connect",
    "names",
    "quit_qemu",
    "watch_domains",
]

_KINDS: dict[str, TransportKind] = {}


def register(kind: TransportKind, *, first: bool = False) -> None:
    """Make ``kind`` known as ``--transport NAME``, after those registered before it
    (``first``: before them, so that ``auto`` asks it first)."""
    _KINDS.pop(kind.name, None)
    before = dict(_KINDS) if first else {}
    if first:
        _KINDS.clear()
    _KINDS[kind.name] = kind
    _KINDS.update(before)


def unregister(name: str) -> None:
    """Forget the transport ``--transport NAME``."""
    _KINDS.pop(name, None)


def names() -> list[str]:
    """``--transport`` choices: ``auto``, then every transport by name, in registry order."""
    return [AUTO, *_KINDS]


def choose(reach: Reach) -> tuple[TransportKind, str | None]:
    """The kind ``reach`` asks for, and why the one before it was passed over (``auto``; None
    when the user named it or it is the first). UsageError when no kind fits the addresses given."""
    given = reach.addresses
    if reach.transport != AUTO:
        kind = _KINDS.get(reach.transport)
        if kind is None:
            raise UsageError(f"--transport {reach.transport}: not one of {', '.join(names())}")
        if not kind.needs & given:
            raise UsageError(f"--transport {kind.name} needs {_described(kind.needs)}")
        return kind, None
    passed: list[str] = []
    for kind in _KINDS.values():
        if kind.needs & given:
            return kind, passed[-1] if passed else None
        passed.append(f"{kind.name} needs {_described(kind.needs)}, not {_described(given)}")
    raise UsageError(f"no transport can use {_described(given)}")


async def connect(reach: Reach) -> Opened:
    """A transport to the guest at ``reach``, of the kind ``choose`` picks, opened."""
    kind, passed_over = choose(reach)
    return await kind.open(reach, passed_over)


def boot_files(reach: Reach) -> BootFiles:
    """The kernel and initrd the VM at ``reach`` boots directly, as far as whoever runs it
    names them (a libvirt domain's XML); none for a VM reached by its sockets, whose command
    line qmpprof does not see. Read before the guest is touched: it asks libvirt, not QEMU."""
    if reach.domain is None:
        return BootFiles()
    from qmpprof.transport.libvirtdomain import domain_boot_files  # libvirt: see watch_domains

    return domain_boot_files(reach.connect, reach.domain)


def watch_domains(uri: str, changed: Callable[[], None]) -> DomainSet:
    """The running domains at libvirt's ``uri``, ``changed`` called (in another thread) at each
    lifecycle event; ConnectError when libvirt refuses ``uri``."""
    # Imported here: libvirt's binding is needed by serve --libvirt and the libvirt kind alone.
    from qmpprof.transport.libvirtwatch import DomainWatch

    return DomainWatch.open(uri, changed)


def _described(addresses: frozenset[Address]) -> str:
    return " or ".join(sorted(address.value for address in addresses))


register(kinds.GdbKind())
register(kinds.PrivateGdbKind())
register(kinds.QmpKind())
register(kinds.LibvirtKind())
