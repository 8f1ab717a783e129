"""How a run is built, in one place: the guest OS, the instruction set and the transport from
their registries, the unwinder and the sampler's configuration, from a RunSpec (what to profile
and how). The command line (profile, record, demo), serve and the benchmark build their runs here;
nothing here prints or parses flags, and nothing here names a guest OS or an instruction set.

Files are loaded and indexed before the guest is touched (``load``), so a bad file fails before
anything is stopped, and nothing heavy is left for the first pause.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qmpprof import arch as arches
from qmpprof import transport as transports
from qmpprof.errors import ConnectError, UsageError
from qmpprof.guest import registry as guests
from qmpprof.guest.base import Guest, GuestSpec, KernelFile, TaskLister
from qmpprof.offcpu import OffCpuTasks
from qmpprof.sampler import Sampler, SamplerConfig
from qmpprof.stats import SamplerStats
from qmpprof.transport.base import GuestTransport, Reach
from qmpprof.unwind.chain import AddressSpace, RawStack, Unwinder

# A socket /proc shows held gets this long to greet all the same: the client seen may have
# just left (QEMU closes its side of a connection a moment after the client).
HELD_GRACE = 0.5


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything a run needs to be built. ``sampling.window`` is adjusted to the transport."""

    # Where the guest is and which transport the user asked for (qmpprof.transport chooses).
    reach: Reach = dataclasses.field(default_factory=Reach)
    kernel: Path | None = None
    user_dir: Path | None = None
    # How the guest tells its processes apart: a name of qmpprof.guest's registry, or "auto"
    # (the first guest OS that recognises the kernel file).
    os: str = guests.AUTO
    # The guest OSes' options given (guest.base.GuestOption) as (key, value) pairs: passed
    # through untouched to the OS chosen (Linux's kallsyms, the Emerald page's address, a
    # kernel description). Pairs, not a dict: a RunSpec is a value (serve keeps distinct ones).
    os_options: tuple[tuple[str, object], ...] = ()
    # Resolve source lines and inlined frames where DWARF has them (for --lines, and for saved
    # profiles, which any naming may render later); off, frames carry no lines (cheaper).
    lines: bool = False
    # Every task off CPU at each tick too (a guest OS that tells its tasks).
    off_cpu: bool = False
    sampling: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)


def with_boot_files(spec: RunSpec) -> tuple[RunSpec, tuple[str, ...]]:
    """``spec`` with the files the VM boots directly where the user gave none, as whoever runs
    it names them (a libvirt domain's ``<kernel>`` and ``<initrd>``: ``transport.boot_files``):
    the kernel, and each guest OS option that takes a boot file (``GuestOption.booted``); and
    what the user should be told of it, one line each."""
    given = dict(spec.os_options)
    # The initrd holds the user programs, which a --user-dir given names already.
    takers = [o for o in guests.options() if o.booted is not None and o.key not in given]
    takers = [] if spec.user_dir is not None else takers
    if spec.kernel is not None and not takers:
        return spec, ()
    booted = transports.boot_files(spec.reach)
    notes = list(booted.notes)
    if spec.kernel is None and booted.kernel is not None:
        spec = dataclasses.replace(spec, kernel=booted.kernel)
        notes.append(f"--kernel {booted.kernel}: the kernel {spec.reach.where} boots")
    for option in takers:
        path = booted.initrd if option.booted == "initrd" else None
        if path is not None:
            given[option.key] = path
            notes.append(f"{option.flag} {path}: the {option.booted} {spec.reach.where} boots")
    return dataclasses.replace(spec, os_options=tuple(given.items())), tuple(notes)


def load(spec: RunSpec) -> Guest:
    """The run's guest OS, its files read and indexed (before the guest is touched): the
    registry's choice for ``spec.os`` and the kernel file."""
    kernel = None if spec.kernel is None else KernelFile.open(spec.kernel)
    options = dict(spec.os_options)
    kind = guests.choose(spec.os, kernel, given=options)
    guest_spec = GuestSpec(
        arch=(kernel.arch if kernel is not None else None) or arches.default(),
        kernel=kernel,
        user_dir=spec.user_dir,
        lines=spec.lines,
        auto=spec.os == guests.AUTO,
        options=options,
    )
    return kind.load(guest_spec)


@dataclass(frozen=True, slots=True)
class Connection:
    """An open transport, how samples travel through it and what was learnt of the guest
    (lines for ``--verbose``), and ``notes``: what the user should be told in any case (a
    kernel without BTF, say), one line each; ``window``: the transport's stack window (None:
    the run's own)."""

    transport: GuestTransport
    path: str
    detail: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    window: int | None = None


async def connect(spec: RunSpec) -> Connection:
    """The transport the registry chooses for ``spec.reach``, opened."""
    opened = await transports.connect(spec.reach)
    return Connection(opened.transport, opened.path, notes=opened.notes, window=opened.window)


def check_socket(path: Path, timeout: float = 5.0) -> None:
    """That a QMP server answers at ``path`` (a greeting read, nothing sent), before any file
    is loaded: a ConnectError naming what is there instead. QEMU serves one client per QMP
    socket and greets a second only once the first leaves: a socket whose accepted
    connections /proc/net/unix lists is held by another client, told after HELD_GRACE."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConnectError(
            f"no QMP socket at {path} (is QEMU running with -qmp unix:...?)"
        ) from None
    except OSError as err:
        raise ConnectError(f"{path}: {err.strerror or err}") from None
    if stat.S_ISDIR(mode):
        raise ConnectError(f"{path}: a directory, not a QMP socket")
    if not stat.S_ISSOCK(mode):
        raise ConnectError(f"{path}: a file, not a socket (give QEMU's -qmp unix:PATH socket)")
    held = _clients(path)
    greeting = _greeting(path, HELD_GRACE if held else timeout)
    if greeting is not None:
        return
    if held:
        raise ConnectError(
            f"{path}: another client holds this QMP socket (QEMU serves one at a time): close"
            " it, or give the VM a second -qmp socket for qmpprof"
        )
    why = "not a QMP server" if held == 0 else "not a QMP server, or another client holds it"
    raise ConnectError(f"{path}: no QMP greeting within {timeout:g} s ({why})")


def _clients(path: Path) -> int | None:
    """How many connections the server at ``path`` has accepted, by /proc/net/unix (each is
    listed with the path its server bound, state 03; one waiting to be accepted, 02); None
    when that cannot be told: no /proc, or a server that bound a relative path."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
        target = path.stat()
    except OSError:
        return None
    listening, accepted = False, 0
    for line in lines:
        fields = line.split(maxsplit=7)
        if len(fields) < 8 or not fields[7].startswith("/") or Path(fields[7]).name != path.name:
            continue
        try:
            bound = os.stat(fields[7])
        except OSError:
            continue
        if (bound.st_dev, bound.st_ino) == (target.st_dev, target.st_ino):
            listening |= fields[5] == "01"
            accepted += fields[5] == "03"
    return accepted if listening else None


def _greeting(path: Path, timeout: float) -> bytes | None:
    """QEMU's greeting at ``path``, None when none came within ``timeout``; a ConnectError
    when nothing listens there or what answered is not QMP. Events before the greeting are
    passed over: a connection QEMU accepts as the client before it leaves can be handed the
    events that client's last moments queued (seen on QEMU 7.2, two profilers on one VM)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        peer.settimeout(timeout)
        received = b""
        try:
            peer.connect(str(path))
            while True:
                line, newline, rest = received.partition(b"\n")
                if newline and line.startswith(b'{"QMP"'):
                    return line
                if newline and _is_event(line):
                    received = rest
                    continue
                if newline or len(received) > _GREETING_MAX:
                    break
                more = peer.recv(4096)
                if not more:
                    break
                received += more
        except TimeoutError:
            return None
        except ConnectionRefusedError:
            raise ConnectError(f"{path}: nothing listens on this socket (QEMU gone?)") from None
        except OSError as err:
            raise ConnectError(f"{path}: {err.strerror or err}") from None
    said = f"it said {received[:40]!r}" if received else "it closed the connection"
    raise ConnectError(f"{path}: not a QMP server ({said})")


_GREETING_MAX = 64 * 1024  # bytes of a line that is still not a whole greeting: not QMP


def _is_event(line: bytes) -> bool:
    try:
        message = json.loads(line)
    except ValueError:
        return False
    return isinstance(message, dict) and "event" in message


async def attach(guest: Guest, connection: Connection) -> Connection:
    """The guest OS attached to the running guest through ``connection``, what it learnt
    added to the connection's lines; the transport is closed if that fails."""
    try:
        attached = await guest.attach(connection.transport)
    except BaseException:
        await connection.transport.close()
        raise
    return dataclasses.replace(
        connection,
        detail=connection.detail + attached.detail,
        notes=connection.notes + attached.notes,
    )


async def check_cpus(cpus: tuple[int, ...] | None, transport: GuestTransport) -> None:
    """The vCPUs asked for are the guest's, told as soon as its vCPUs are known."""
    if cpus is None:
        return
    present = await transport.cpus()
    absent = sorted(set(cpus) - set(present))
    if absent:
        have = ", ".join(map(str, present))
        raise UsageError(f"--cpus: this guest has no vCPU {absent[0]} (its vCPUs: {have})")


def sampler_config(spec: RunSpec, connection: Connection) -> SamplerConfig:
    """The sampling configuration, its stack window no wider than the transport's."""
    window = spec.sampling.window
    if connection.window is not None:
        window = min(window, connection.window)
    return dataclasses.replace(spec.sampling, window=window)


def unwinder(spec: RunSpec, guest: Guest) -> Unwinder:
    """The walker of the guest kernel's instruction set, split at ``--kernel-boundary``, else
    where the kernel's ELF says, else at the instruction set's default."""
    boundary = spec.sampling.kernel_boundary
    if boundary is None and spec.kernel is not None:
        boundary = KernelFile.open(spec.kernel).kernel_boundary(guest.arch.kernel_boundary)
    return Unwinder(guest.arch, kernel_boundary=boundary, lines=spec.lines)


Run = Sampler[AddressSpace, RawStack]


def sampler(
    spec: RunSpec,
    guest: Guest,
    connection: Connection,
    on_tick: Callable[[SamplerStats], None] | None = None,
) -> Run:
    """A sampler of ``guest`` over ``connection`` (attached), ready to run; with
    ``spec.off_cpu``, the tasks off CPU at each tick too (``OffCpuTasks``: looked at between
    ticks, as housekeeping)."""
    walker = unwinder(spec, guest)
    config = sampler_config(spec, connection)
    transport = connection.transport
    waiting = None
    if spec.off_cpu:
        lister = task_lister(guest)
        if transport.control is None:
            raise UsageError("--off-cpu needs QEMU's monitor, which --transport gdb has not")
        boundary = (
            walker.kernel_boundary if config.kernel_boundary is None else config.kernel_boundary
        )
        waiting = OffCpuTasks(transport.control, lister, walker, boundary)
    return Sampler(
        transport,
        walker,
        guest,
        config,
        on_tick=on_tick,
        housekeeping=guest.housekeep,
        off_cpu=waiting,
    )


def task_lister(guest: Guest) -> TaskLister:
    """``guest`` as one that tells every task (for ``--off-cpu``); UsageError when it cannot."""
    if not isinstance(guest, TaskLister):
        raise UsageError(
            "--off-cpu needs a guest OS that tells its tasks (--os linux, or a --describe file"
            " with 'tasks')"
        )
    return guest


NO_KERNEL = (
    "no --kernel: kernel code has no names ([unknown]) and kernel stacks end at their first"
    " frame ([truncated]); give the guest kernel's ELF file with --kernel FILE"
)


async def start(
    spec: RunSpec,
    on_tick: Callable[[SamplerStats], None] | None = None,
    on_connect: Callable[[Connection], None] | None = None,
    guest: Guest | None = None,
) -> Run:
    """A sampler connected to the guest, ready to run; the caller closes its transport.
    ``on_connect`` hears how samples travel and what was learnt of the guest, once connected.
    Files are loaded before the guest is touched (unless ``guest`` was loaded already): a bad
    one fails first."""
    guest = load(spec) if guest is None else guest
    connection = await connect(spec)
    try:
        await check_cpus(spec.sampling.cpus, connection.transport)
    except BaseException:
        await connection.transport.close()
        raise
    connection = await attach(guest, connection)
    if spec.kernel is None and not any(guests.option(k).symbols for k, _ in spec.os_options):
        notes = (*connection.notes, NO_KERNEL)
        connection = dataclasses.replace(connection, notes=notes)
    if on_connect is not None:
        on_connect(connection)
    return sampler(spec, guest, connection, on_tick)
