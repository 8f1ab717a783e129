"""The guest OSes qmpprof reads, each behind ``base.GuestOs``: this is their registry. ``--os
auto`` takes the first, in registry order, that recognises the kernel file; a new guest OS is a
module (or package) of its own and a ``register`` line below."""

from __future__ import annotations

from qmpprof.errors import UsageError
from qmpprof.guest import cr3, emerald
from qmpprof.guest.base import GuestOs, KernelFile
from qmpprof.guest.describe.guest import DescribedOs
from qmpprof.linux.running.linuxos import LINUX

AUTO = "auto"
DESCRIBED = DescribedOs.name
_OSES: dict[str, GuestOs] = {}


def register(kind: GuestOs, *, first: bool = False) -> None:
    """Make ``kind`` known as ``--os NAME``, after those registered before it (``first``:
    before them, so that ``auto`` asks it first)."""
    _OSES.pop(kind.name, None)
    before = dict(_OSES) if first else {}
    if first:
        _OSES.clear()
    _OSES[kind.name] = kind
    _OSES.update(before)


def unregister(name: str) -> None:
    """Forget the guest OS ``--os NAME``."""
    _OSES.pop(name, None)


def names() -> list[str]:
    """``--os`` choices: ``auto``, then every guest OS by name, in registry order."""
    return [AUTO, *_OSES]


def choose(name: str, kernel: KernelFile | None, *, described: bool = False) -> GuestOs:
    """The guest OS ``--os NAME`` means for a run with ``kernel`` (``auto``: the first that
    recognises it, or the described kernel's for a run with a description)."""
    if described and name not in (AUTO, DESCRIBED):
        raise UsageError(f"--describe goes with --os auto or {DESCRIBED}, not --os {name}")
    if name == AUTO and described:
        return _OSES[DESCRIBED]
    if name == AUTO:
        for kind in _OSES.values():
            if kind.recognises(kernel):
                return kind
        raise UsageError("no guest OS recognises this run: give --os")
    try:
        return _OSES[name]
    except KeyError:
        raise UsageError(f"--os {name}: not one of {', '.join(names())}") from None


register(LINUX)
register(emerald.EmeraldOs())
register(cr3.Cr3Os())
register(DescribedOs())
