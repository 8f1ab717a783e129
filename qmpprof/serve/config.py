"""Per-VM settings of ``qmpprof serve``, read from TOML files.

``--config FILE`` holds a table per VM; a VM found in ``--qmp-dir`` may have ``NAME.toml``
beside its socket ``NAME``, with the same keys at the top level (no ``socket``). The flags on
the command line are every VM's defaults; ``--config`` overrides them, ``NAME.toml`` overrides
both. Relative paths are taken from the file's folder::

    [vm.web1]
    socket = "/run/qemu/web1.qmp"     # followed as --qmp-socket web1=... would be
    kernel = "/boot/vmlinuz-6.12.57"  # the kernel this VM runs
    kallsyms = "System.map-6.12.57"
    user_dir = "rootfs/web1"
    os = "linux"
    interval = 50                     # ms, the shortest interval
    max_overhead = 1                  # percent of the wall time stopped; 0 or "none": no budget
    off_cpu = true                    # the tasks off CPU too (a Linux guest), as --off-cpu

A file that cannot be read, is not TOML, or holds a key or value qmpprof does not take is a
UsageError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qmpprof import bounds
from qmpprof.errors import UsageError
from qmpprof.guest import registry as guests
from qmpprof.guest.base import GuestOption
from qmpprof.session import RunSpec

# The longest interval serve's budget may ask for (pauses of up to 45 ms still fit in 1 %), and
# so the longest --interval or ``interval`` it takes.
MAX_INTERVAL = 5.0


class _Bad(Exception):
    """A value a key does not take: what it should be."""


@dataclass(frozen=True, slots=True)
class VmSettings:
    """One VM's overrides: RunSpec fields, SamplerConfig fields, and its socket if given."""

    socket: Path | None = None
    # (field, value): each value read by its key's reader, of the field's type
    run: tuple[tuple[str, Any], ...] = ()
    sampling: tuple[tuple[str, Any], ...] = ()
    # (key, value): the guest OSes' options (guest.base.GuestOption), over the flags' ones
    os_options: tuple[tuple[str, object], ...] = ()

    def apply(self, spec: RunSpec) -> RunSpec:
        sampling = dataclasses.replace(spec.sampling, **dict(self.sampling))
        options = tuple({**dict(spec.os_options), **dict(self.os_options)}.items())
        return dataclasses.replace(spec, **dict(self.run), sampling=sampling, os_options=options)


def _path(folder: Path) -> Callable[[object], Path]:
    def read(value: object) -> Path:
        if not isinstance(value, str) or not value:
            raise _Bad("a path (a string)")
        try:
            path = Path(value).expanduser()
        except RuntimeError:  # "~user" of no such user
            raise _Bad(f"a path whose ~ names a user here, not {value!r}") from None
        return path if path.is_absolute() else folder / path

    return read


def _option(option: GuestOption, folder: Path) -> Callable[[object], object]:
    """A guest OS's option as a TOML value: a path from the file's folder, or a value read
    from its text (a number or a string: an address past 2^63 is no TOML integer)."""
    if option.kind != "value":
        return _path(folder)

    def read(value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise _Bad("a string")
        try:
            return option.value(str(value))
        except ValueError as err:
            raise _Bad(str(err)) from None

    return read


def _os(value: object) -> str:
    if not isinstance(value, str) or value not in guests.names():
        raise _Bad(f"one of {', '.join(guests.names())}")
    return value


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Bad("true or false")
    return value


def _interval(value: object) -> float:
    if isinstance(value, str):  # TOML's numbers are not strings: "50" is a slip
        raise _Bad("a number of milliseconds, not a string")
    try:
        return bounds.interval(value, MAX_INTERVAL)
    except bounds.OutOfBounds as err:
        raise _Bad(str(err)) from None


def _overhead(value: object) -> float | None:
    if value == "none" or (value == 0 and not isinstance(value, bool)):
        return None
    if isinstance(value, str):
        raise _Bad('a percentage in (0, 100), or 0 or "none" for no budget')
    try:
        return bounds.overhead(value)
    except bounds.OutOfBounds as err:
        raise _Bad(f'{err}, or 0 or "none" for no budget') from None


def parse_interval(value: float) -> float:
    """``--interval MS``: seconds, by the rule of the TOML key."""
    try:
        return bounds.interval(value, MAX_INTERVAL)
    except bounds.OutOfBounds as err:
        raise UsageError(f"--interval must be {err}, not {value:g}") from None


def parse_overhead(text: str) -> float | None:
    """``--max-overhead PCT``: the budget as a fraction, None for 0 or ``none``."""
    try:
        return _overhead(text if text == "none" else bounds.number(text))
    except (bounds.OutOfBounds, _Bad):
        wanted = 'a percentage in (0, 100), 0 or "none"'
        raise UsageError(f"--max-overhead: {wanted}, not {text!r}") from None


def _keys(folder: Path) -> dict[str, tuple[str, str, Callable[[object], object]]]:
    """TOML key -> (where it goes: run, sampling or os_options; field; its reader): serve's
    own keys, then each guest OS's options (guest.base.GuestOption) by their keys."""
    path = _path(folder)
    keys = {
        "kernel": ("run", "kernel", path),
        "user_dir": ("run", "user_dir", path),
        "os": ("run", "os", _os),
        "off_cpu": ("run", "off_cpu", _bool),
        "interval": ("sampling", "interval", _interval),
        "max_overhead": ("sampling", "max_overhead", _overhead),
    }
    for option in guests.options():
        keys[option.key] = ("os_options", option.key, _option(option, folder))
    return keys


def settings(table: Mapping[str, object], where: str, folder: Path, *, socket: bool) -> VmSettings:
    """One VM's table; ``where`` goes before a key in errors (``FILE: vm.NAME.``)."""
    keys = _keys(folder)
    found: dict[str, list[tuple[str, object]]] = {"run": [], "sampling": [], "os_options": []}
    at: Path | None = None
    for key, value in table.items():
        try:
            if key == "socket" and socket:
                at = _path(folder)(value)
                continue
            if key not in keys:
                known = ", ".join(["socket", *keys] if socket else keys)
                raise _Bad(f"not a key qmpprof knows ({known})")
            part, field, read = keys[key]
            found[part].append((field, read(value)))
        except _Bad as bad:
            raise UsageError(f"{where}{key}: {bad}") from None
    parts = (tuple(found[part]) for part in ("run", "sampling", "os_options"))
    return VmSettings(at, *parts)


def _toml(path: Path) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise UsageError(f"{path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: not TOML: not UTF-8 (byte {err.start})") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"{path}: not TOML: {err}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise UsageError(f"{path}: not TOML qmpprof reads: nested too deep") from None


def read_config(path: Path) -> dict[str, VmSettings]:
    """``--config FILE``: its VMs by name."""
    data = _toml(path)
    out: dict[str, VmSettings] = {}
    for key, value in data.items():
        if key != "vm" or not isinstance(value, dict):
            raise UsageError(f"{path}: {key}: not a key qmpprof knows (VMs go in [vm.NAME])")
        for name, table in value.items():
            if not isinstance(table, dict):
                raise UsageError(f"{path}: vm.{name}: not a table ([vm.{name}])")
            out[name] = settings(table, f"{path}: vm.{name}.", path.parent, socket=True)
    return out


def read_beside(path: Path) -> VmSettings:
    """``NAME.toml`` beside a socket of --qmp-dir: one VM's keys at the top level."""
    return settings(_toml(path), f"{path}: ", path.parent, socket=False)
