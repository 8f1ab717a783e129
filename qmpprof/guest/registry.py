"""The guest OSes qmpprof reads, each behind ``base.GuestOs``: this is their registry. ``--os
auto`` takes the first, in registry order, that recognises the kernel file, or the OS whose
choosing option was given (``--describe``); a new guest OS is a module (or package) of its own
and a ``register`` line below. Each OS's options (``GuestOption``) become the flags of the
profiling command and serve and serve's TOML keys (``options``)."""

from __future__ import annotations

from collections.abc import Collection

from qmpprof.errors import UsageError
from qmpprof.guest import cr3, emerald
from qmpprof.guest.base import GuestOption, GuestOs, KernelFile
from qmpprof.guest.describe.guest import DescribedOs
from qmpprof.linux.running.linuxos import LINUX

AUTO = "auto"
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


def options() -> list[GuestOption]:
    """Every guest OS's options, once each by key, in registry order."""
    found: dict[str, GuestOption] = {}
    for kind in _OSES.values():
        for option in kind.options:
            found.setdefault(option.key, option)
    return list(found.values())


def option(key: str) -> GuestOption:
    """The option ``key`` a registered guest OS declares (KeyError: none does)."""
    for found in options():
        if found.key == key:
            return found
    raise KeyError(key)


def choose(name: str, kernel: KernelFile | None, given: Collection[str] = ()) -> GuestOs:
    """The guest OS ``--os NAME`` means for a run with ``kernel`` and the guest OSes' options
    ``given`` (keys): ``auto``, the OS whose choosing option was given, else the first that
    recognises the kernel file; a choosing option with another ``--os`` is a UsageError."""
    for kind in _OSES.values():
        chosen = [o for o in kind.options if o.chooses and o.key in given]
        if not chosen:
            continue
        if name not in (AUTO, kind.name):
            flag = chosen[0].flag
            raise UsageError(f"{flag} goes with --os auto or {kind.name}, not --os {name}")
        return kind
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
