"""The command line of the profiling command: flags, their checks, and the Options they produce.

Every bad value becomes a UsageError (one line, exit 2), never argparse's own usage dump.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TypedDict, TypeVar

from qmpprof import __version__, bounds
from qmpprof import arch as arches
from qmpprof import transport as transports
from qmpprof.cli.commands import SUBCOMMANDS
from qmpprof.errors import UsageError, exit_codes
from qmpprof.guest import registry as guests
from qmpprof.model import Mode
from qmpprof.naming import Naming
from qmpprof.output import FORMATS, format_for
from qmpprof.sampler import SamplerConfig
from qmpprof.session import RunSpec
from qmpprof.transport import Reach

T = TypeVar("T")
# No QEMU machine comes near this many vCPUs: a higher index is a slip, and expanding a range
# to it would fill memory.
MAX_VCPUS = 8192


@dataclass(frozen=True, slots=True)
class Options:
    spec: RunSpec  # what to profile and how (session.py builds the run from it)
    outputs: tuple[Path, ...]
    fmt: str | None
    one_shot: bool
    json: bool
    naming: Naming
    verbose: bool
    off_cpu: bool = False  # every task off CPU (one_shot: every task, its state and stacks)
    label: str | None = None  # what titles call the guest (record, demo); else where it is

    @property
    def guest(self) -> str:
        """What was profiled: the label given, else where the guest is, as the user named it."""
        return self.label if self.label is not None else self.spec.reach.where


class _Help(argparse.HelpFormatter):
    """``--help`` with each flag's default after its text, where it has one to say."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return action.help
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every command's parser: a bad flag is a UsageError (one line), not argparse's dump."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def add_view_flags(p: argparse.ArgumentParser) -> None:
    """How frames are named and which samples are kept: the profiling command's and report's."""
    add = p.add_argument
    add("--show-addresses", action="store_true", help="show frame addresses")
    add("--offsets", action="store_true", help="name frames function+offset")
    add("--lines", action="store_true",
        help="name frames 'function (file:line)' from DWARF, with inlined functions as frames "
             "of their own, marked _[i]")  # fmt: skip
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-k", "--kernel-only", action="store_true",
        help="keep only samples taken in kernel mode (RIP at or above the kernel boundary), "
             "with only their kernel frames: the user frames below a system call or "
             "interrupt are dropped")  # fmt: skip
    mode.add_argument("-u", "--user-only", action="store_true",
        help="keep only samples taken in user mode (RIP below the kernel boundary)")  # fmt: skip
    add("--cpus", metavar="LIST", help="vCPUs to keep, e.g. 0,2-3 (default: all)")


def add_guest_flags(p: argparse.ArgumentParser) -> None:
    """What the guest runs and how it tells its processes apart: the profiling command's and
    serve's."""
    add = p.add_argument
    add("--kernel", metavar="FILE",
        help="the guest kernel: its ELF file (symbols, CFI), or for Linux the vmlinuz (bzImage; "
             "arm64 Image, Image.gz or EFI zboot) or vmlinux it booted")  # fmt: skip
    add("--user-dir", metavar="DIR",
        help="the guest's user program ELF files (for Linux: a copy of its root filesystem, or "
             "a folder with its programs and libraries)")  # fmt: skip
    defaults = ", ".join(
        f"{arches.by_name(name).kernel_boundary:#x} on {name}" for name in arches.names()
    )
    add(
        "--kernel-boundary",
        metavar="ADDR",
        help="lowest kernel address (default: where the --kernel ELF's segments say, for a kernel "
        f"linked below its instruction set's split, else that split: {defaults})",
    )
    for option in guests.options():  # each guest OS's own (guest.base.GuestOption)
        add(option.flag, metavar=option.metavar, help=option.help)
    add("--no-metadata", action="store_true", help="the same as --os cr3")
    add(
        "--os",
        choices=guests.names(),
        default=guests.AUTO,
        help="how the guest tells its processes apart: Linux's current task (linux), the "
        "Emerald metadata page (emerald), page-table roots alone (cr3), a kernel description "
        "(described, with --describe), or auto (the default): described with --describe, "
        "linux for a Linux --kernel, else the page when it is there",
    )


class GuestFields(TypedDict):
    """The RunSpec fields add_guest_flags sets (kernel_boundary goes to the SamplerConfig)."""

    kernel: Path | None
    user_dir: Path | None
    os: str
    os_options: tuple[tuple[str, object], ...]


def guest_fields(ns: argparse.Namespace) -> GuestFields:
    return {
        "kernel": Path(ns.kernel) if ns.kernel else None,
        "user_dir": Path(ns.user_dir) if ns.user_dir else None,
        "os": "cr3" if ns.no_metadata else ns.os,
        "os_options": os_options_of(ns),
    }


def os_options_of(ns: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    """The guest OSes' options given on the command line, each read by its own rule."""
    found: list[tuple[str, object]] = []
    for option in guests.options():
        text = getattr(ns, option.key, None)
        if text is None:
            continue
        try:
            found.append((option.key, option.value(text)))
        except ValueError as err:
            raise UsageError(f"{option.flag}: {err}") from None
    return tuple(found)


def kernel_boundary_of(ns: argparse.Namespace) -> int | None:
    """``--kernel-boundary``, else None: the default of the kernel's instruction set."""
    if ns.kernel_boundary is None:
        return None
    return parse_address(ns.kernel_boundary, "--kernel-boundary")


def outputs_of(ns: argparse.Namespace) -> tuple[Path, ...]:
    """The -o files, each with a format a bad --format or name fails on now, before any run."""
    if ns.format is not None and len(ns.output) > 1:
        raise UsageError("--format applies to one -o; with several, their names choose")
    outputs = tuple(Path(o) for o in ns.output)
    for path in outputs:
        format_for(path, ns.format)
    return outputs


def check_files(spec: RunSpec) -> None:
    """The files the flags name are there: a missing one is a UsageError for every flag alike;
    what they hold is read later (ElfError, exit 6, for one that is not what it should be)."""
    named = [("--kernel", spec.kernel, False), ("--user-dir", spec.user_dir, True)]
    for key, value in spec.os_options:
        option = guests.option(key)
        if option.kind != "value" and isinstance(value, Path):
            named.append((option.flag, value, option.kind == "folder"))
    for flag, path, folder in named:
        if path is None:
            continue
        if not path.exists():
            raise UsageError(f"{flag} {path}: no such file or directory")
        if path.is_dir() != folder:
            raise UsageError(f"{flag} {path}: {'not a directory' if folder else 'a directory'}")


def naming_of(ns: argparse.Namespace) -> Naming:
    return Naming.of(offsets=ns.offsets, lines=ns.lines, show_addresses=ns.show_addresses)


def mode_of(ns: argparse.Namespace) -> Mode | None:
    return Mode.KERNEL if ns.kernel_only else Mode.USER if ns.user_only else None


def exit_codes_epilog() -> str:
    """The exit codes for --help: the error tree's (qmpprof/errors.py) between the two that
    are no error, done and ended by a signal (128 + SIGINT's or SIGTERM's number)."""
    errors = ", ".join(f"{code} {meaning}" for code, meaning in exit_codes().items())
    return f"Exit codes: 0 done, {errors}, 130/143 interrupted."


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="qmpprof",
        usage=f"%(prog)s [options]\n       %(prog)s {{{','.join(SUBCOMMANDS)}}} [options] "
        "(each with --help)",
        description="Sample the stacks of a QEMU guest's kernel and processes over QMP. The "
        "commands: record starts QEMU and profiles it from its first instruction; demo "
        "profiles the bundled guest; report renders a saved profile again; diff compares two; "
        "serve profiles guests continuously over HTTP; top shows a running guest live.",
        epilog=exit_codes_epilog(),
    )
    add = p.add_argument
    add("--qmp-socket", metavar="PATH", default="./qmp-socket", help="QMP Unix socket")
    add("--qmp", metavar="HOST:PORT", help="QMP over TCP (memory is then read with HMP x)")
    add("--transport", choices=transports.names(),
        help="auto (the default): on a local QMP socket, a private gdbstub qmpprof opens over "
             "QMP and removes at the end (falls back to QMP, --verbose says why); private-gdb: "
             "as auto on a local QMP socket; qmp: QMP and HMP only; gdb: the gdbstub at "
             "--gdb; libvirt: --domain's monitor, through libvirt")  # fmt: skip
    add("--domain", metavar="NAME",
        help="a running libvirt domain, reached through libvirt's QEMU monitor passthrough "
             "(libvirt marks the domain tainted: custom-monitor)")  # fmt: skip
    add("--connect", metavar="URI", help="libvirt's URI for --domain (default: as virsh takes it)")
    add("--gdb", metavar="HOST:PORT",
        help="a gdbstub the VM already has (implies --transport gdb)")  # fmt: skip
    add("--memory", choices=("auto", "memsave", "hmp"), default="auto",
        help="how QMP reads memory (default: memsave on a local socket, else HMP x)")  # fmt: skip
    add("--interval", metavar="MS", type=float, default=10.0, help="guest run time between samples")
    add("--duration", metavar="S", type=float, default=5.0, help="guest run time to profile")
    add("--jitter", metavar="FRACTION", type=float, nargs="?", const=0.2, default=0.0,
        help="randomise each interval by +-FRACTION (default 0.2 when given)")  # fmt: skip
    add("--max-overhead", metavar="PCT", type=float,
        help="keep the guest stopped at most PCT %% of the wall time: intervals lengthen when "
             "pauses grow, and the run ends after --duration of guest run time")  # fmt: skip
    add(
        "-o",
        "--output",
        metavar="FILE",
        action="append",
        default=[],
        help="write the profile here (else print top stacks); repeat for several files: "
        "FILE.svg, FILE.folded, FILE.speedscope.json, FILE.pb.gz (pprof), FILE.qmpprof "
        "(re-renderable); - for standard output (in --format, else folded)",
    )
    add("--format", metavar="FMT", help="output format (default: from the file name, else folded)")
    add("--one-shot", action="store_true", help="take one sample of every vCPU and print it")
    add("--json", action="store_true", help="with --one-shot: print the stacks as JSON")
    add(
        "--off-cpu",
        action="store_true",
        help="every task of a Linux guest off CPU too, at each tick, under [off-cpu: STATE]; "
        "with --one-shot: every task, its state and, off CPU, its stacks",
    )
    add_view_flags(p)
    add("-v", "--verbose", action="store_true", help="more detail in the summary")
    add_guest_flags(p)
    add("--version", action="version", version=f"qmpprof {__version__}")
    return p


def parse(argv: list[str]) -> Options:
    return options_of(parser().parse_args(argv))


def options_of(ns: argparse.Namespace) -> Options:
    """The Options the profiling command's flags (``parser()``'s, or a parser built on it) say."""
    duration = checked(bounds.duration, ns.duration, "--duration")
    interval = checked(partial(_interval, duration=duration), ns.interval, "--interval")
    jitter = checked(bounds.jitter, ns.jitter, "--jitter")
    overhead = None
    if ns.max_overhead is not None:
        overhead = checked(bounds.overhead, ns.max_overhead, "--max-overhead")
    if ns.json and not ns.one_shot:
        raise UsageError("--json needs --one-shot")
    transport: str = ns.transport or ("gdb" if ns.gdb else "auto")
    if transport == "gdb" and not ns.gdb:
        raise UsageError("--transport gdb needs --gdb HOST:PORT")
    if ns.gdb and transport != "gdb":
        raise UsageError(f"--gdb needs --transport gdb, not {transport}")
    if ns.connect and not ns.domain:
        raise UsageError("--connect needs --domain NAME")
    outputs = outputs_of(ns)
    # A saved profile keeps source lines, so that it can be rendered with --lines later; pprof
    # makes its own line views from them.
    with_lines = any(FORMATS[format_for(path, ns.format)].lines for path in outputs)
    spec = RunSpec(
        reach=Reach(
            qmp_socket=Path(ns.qmp_socket),
            qmp_tcp=parse_host_port(ns.qmp) if ns.qmp else None,
            gdb=ns.gdb,
            transport=transport,
            memory=ns.memory,
            domain=ns.domain,
            connect=ns.connect,
        ),
        **guest_fields(ns),
        lines=ns.lines or with_lines,
        off_cpu=ns.off_cpu and not ns.one_shot,
        sampling=SamplerConfig(
            interval=interval,
            duration=duration,
            jitter=jitter,
            cpus=parse_cpus(ns.cpus) if ns.cpus else None,
            kernel_boundary=kernel_boundary_of(ns),
            keep=mode_of(ns),
            max_overhead=overhead,
        ),
    )
    return Options(
        spec=spec,
        outputs=outputs,
        fmt=ns.format,
        one_shot=ns.one_shot,
        json=ns.json,
        naming=naming_of(ns),
        verbose=ns.verbose,
        off_cpu=ns.off_cpu,
    )


def _interval(ms: object, duration: float) -> float:
    value = bounds.number(ms)  # not a number: told as such
    try:
        return bounds.interval(value, duration)
    except bounds.OutOfBounds as err:
        raise bounds.OutOfBounds(f"{err} (no longer than --duration)") from None


def checked(rule: Callable[[object], T], value: object, flag: str) -> T:
    """``value`` by its rule of qmpprof.bounds, else a UsageError naming ``flag``."""
    try:
        return rule(value)
    except bounds.OutOfBounds as err:
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise UsageError(f"{flag} must be {err}, not {shown}") from None


def parse_cpus(text: str) -> tuple[int, ...]:
    """``0,2-3`` -> (0, 2, 3)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise UsageError(f"--cpus: not a vCPU list: {text!r} (e.g. 0,2-3)") from None
        if first < 0 or last < first:
            raise UsageError(f"--cpus: bad range {part.strip()!r}")
        if last >= MAX_VCPUS:
            raise UsageError(f"--cpus: vCPU {last}: QEMU numbers them below {MAX_VCPUS}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def parse_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"not HOST:PORT: {text!r}")
    return (host or "localhost", int(port))


def parse_address(text: str, flag: str) -> int:
    try:
        return bounds.address(text)
    except bounds.OutOfBounds as err:
        raise UsageError(f"{flag}: {err}") from None
