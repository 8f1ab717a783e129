"""``qmpprof record [options] -- QEMU-COMMAND [ARGS...]``: start QEMU, profile it, stop it.

QEMU gets ``-S`` and a QMP socket of qmpprof's own (in a private temporary directory; a -qmp
of the user's own stays, as a second monitor). qmpprof connects while the guest has not run one
instruction, resumes it and samples, so a profile begins at the guest's first instruction.

The run ends when the ``--duration`` of guest run time is over (default 5 s, as for the bare
command), on Ctrl-C/SIGTERM (then QEMU is asked to ``quit``, and killed if it does not), or when
QEMU ends by itself (the guest powered off): that last one is the normal end of a recording, not
an error. Whatever ended it, the profile collected so far is written. QEMU inherits stdin,
stdout and stderr, so the guest console stays where the user's QEMU command line put it.

QEMU shares qmpprof's process group: a Ctrl-C in the terminal reaches both, and QEMU shuts
down on it as it would without qmpprof. QEMU also dies with qmpprof (PR_SET_PDEATHSIG), so a
killed qmpprof never leaves a paused VM behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import qmpprof.cli.options as options
import qmpprof.cli.outputs as outputs
import qmpprof.cli.sample as sample
from qmpprof.cli.options import Options
from qmpprof.errors import (
    ConnectError,
    GuestGoneError,
    QmpprofError,
    TransportError,
    UsageError,
)
from qmpprof.profile import Profile
from qmpprof.session import Run, load
from qmpprof.stats import SamplerStats
from qmpprof.transport import quit_qemu

USAGE = "%(prog)s [options] -- QEMU-COMMAND [ARGS...]"
START_TIMEOUT = 30.0  # QEMU creates its QMP socket within ~0.1 s; leave room for a loaded host
EXIT_TIMEOUT = 5.0  # for QEMU to end after quit, or after it closed the QMP connection
_POLL = 0.01
_SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes

# Flags of the bare command that name a QEMU to connect to: record starts its own.
_NOT_HERE = {
    "qmp_socket": "--qmp-socket",
    "qmp": "--qmp",
    "transport": "--transport",
    "gdb": "--gdb",
    "one_shot": "--one-shot",
    "json": "--json",
    "off_cpu": "--off-cpu",
}


@dataclass(frozen=True, slots=True)
class Recorded:
    """What a recording collected, and how QEMU ended."""

    profile: Profile
    stats: SamplerStats
    exit_status: int | None  # QEMU's status when it ended by itself; None when qmpprof stopped it


def parser() -> argparse.ArgumentParser:
    """The bare command's parser (cli/options.py), retitled, without the connection flags."""
    p = options.parser()
    p.prog = "qmpprof record"
    p.usage = USAGE
    p.description = (
        "Start QEMU paused with a QMP socket of qmpprof's own, profile the guest from its first"
        " instruction until QEMU exits or --duration of guest run time is over (default 5 s),"
        " then stop QEMU and write the profile."
    )
    p.epilog = (
        "Example: qmpprof record -o boot.svg -- qemu-system-x86_64 -accel tcg -kernel vmlinux"
    )
    for action in p._actions:
        if action.dest in _NOT_HERE:
            action.help = argparse.SUPPRESS
    return p


def split_command(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[options] -- command...`` -> (options, command). -h/--version work without ``--``."""
    args = list(args)
    if "--" not in args:
        if {"-h", "--help", "--version"} & set(args):
            parser().parse_args(args)  # prints and exits (SystemExit)
        raise UsageError("record needs the QEMU command after '--': " + _usage())
    i = args.index("--")
    flags, command = args[:i], args[i + 1 :]
    if not command:
        raise UsageError("no QEMU command after '--': " + _usage())
    return flags, command


def _usage() -> str:
    return USAGE.replace("%(prog)s", "qmpprof record")


def parse(flags: Sequence[str], qmp_socket: Path) -> Options:
    """The profiling Options for a recording whose QEMU listens on ``qmp_socket``."""
    p = parser()
    ns = p.parse_args(list(flags))
    for dest, flag in _NOT_HERE.items():
        if getattr(ns, dest) != p.get_default(dest):
            raise UsageError(f"{flag} does not apply to record: it starts QEMU itself")
    return options.parse([*flags, "--qmp-socket", str(qmp_socket)])


def record(
    flags: Sequence[str],
    command: Sequence[str],
    out: TextIO | None = None,
    err: TextIO | None = None,
    *,
    label: str | None = None,
) -> Recorded:
    """Start ``command`` with qmpprof's QMP socket, profile it with ``flags``, stop it.

    ``label`` names the run in titles (default: the QEMU binary and its -kernel file)."""
    workdir = tempfile.mkdtemp(prefix="qmpprof-")  # mode 0700: the socket is ours alone
    if len(workdir) > _SOCKET_PATH_MAX - len("/qmp.sock"):
        Path(workdir).rmdir()
        workdir = tempfile.mkdtemp(prefix="qmpprof-", dir="/tmp")
    try:
        opts = parse(flags, Path(workdir, "qmp.sock"))  # bad flags never start QEMU
        outputs.check(opts.outputs, opts.fmt)
        options.check_files(opts.spec)
        opts = replace(opts, label=label or command_label(command))
        # SIGTERM before or after sampling (which handles it itself) ends the run as Ctrl-C
        # does (qmpprof.interrupts, from main), through the clean-up below.
        qemu = start(command, opts.spec.reach.qmp_socket)
        try:
            return asyncio.run(_record(opts, qemu, Path(command[0]).name, out, err))
        finally:
            if qemu.poll() is None:  # the asynchronous clean-up did not get to run
                qemu.kill()
            qemu.wait()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def command_label(command: Sequence[str]) -> str:
    """``qemu-system-x86_64 -kernel kernel.elf``: the binary and what it boots, if said."""
    words = [Path(command[0]).name]
    for flag in ("-kernel", "-hda", "-drive", "-cdrom"):
        if flag in command[1:-1]:
            words += [flag, Path(command[command.index(flag) + 1]).name]
            break
    return " ".join(words)


def qmp_option(path: Path) -> str:
    """QEMU's ``-qmp`` value for a server socket that does not wait for a client."""
    # QEMU option values escape a comma by doubling it.
    return f"unix:{str(path).replace(',', ',,')},server=on,wait=off"


def start(command: Sequence[str], qmp_socket: Path) -> subprocess.Popen[bytes]:
    """Start QEMU paused (-S) with one more QMP monitor: qmpprof's."""
    argv = [*command, "-S", "-qmp", qmp_option(qmp_socket)]
    try:
        return subprocess.Popen(argv, preexec_fn=_die_with_parent)
    except FileNotFoundError:
        raise UsageError(f"{command[0]}: command not found") from None
    except OSError as err:
        raise UsageError(f"{command[0]}: cannot run it: {err.strerror}") from None


def _die_with_parent() -> None:
    # Runs in the child before exec: should qmpprof be killed outright, its QEMU goes too.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)


def describe_status(status: int) -> str:
    return f"killed by signal {-status}" if status < 0 else f"status {status}"


async def _record(
    opts: Options,
    qemu: subprocess.Popen[bytes],
    name: str,
    out: TextIO | None,
    err: TextIO | None,
) -> Recorded:
    exited: int | None = None
    started: list[Run] = []

    async def resume(sampler: Run) -> None:
        started.append(sampler)
        await sampler.transport.cont()

    try:
        await _wait_socket(opts.spec.reach.qmp_socket, qemu, name)
        await sample.run(opts, load(opts.spec), out, err, on_start=resume)
    except (ConnectError, GuestGoneError, TransportError) as error:
        # The connection failed: because QEMU ended (the guest powered off, or QEMU could not
        # start it), or for a reason of its own while QEMU still runs (then it is stopped below).
        exited = await _wait_exit(qemu, EXIT_TIMEOUT)
        if exited is None:
            raise
        if not started:
            raise GuestGoneError(
                f"{name} exited ({describe_status(exited)}) before the guest started"
            ) from error
    finally:
        if qemu.poll() is None:
            await _stop(opts.spec.reach.qmp_socket, qemu)
    sampler = started[0]
    return Recorded(sampler.profile, sampler.stats, exited)


async def _wait_socket(path: Path, qemu: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not path.exists():
        if qemu.poll() is not None:
            raise GuestGoneError(
                f"{name} exited ({describe_status(qemu.returncode)}) before the guest started"
            )
        if time.monotonic() > deadline:
            raise ConnectError(f"{name} opened no QMP socket within {START_TIMEOUT:g} s")
        await asyncio.sleep(_POLL)


async def _wait_exit(qemu: subprocess.Popen[bytes], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while qemu.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(_POLL)
    return qemu.returncode


async def _stop(qmp_socket: Path, qemu: subprocess.Popen[bytes]) -> None:
    """QMP ``quit`` (HMP's, over qmpprof's own socket); SIGTERM if that cannot be sent; SIGKILL
    when QEMU has not ended EXIT_TIMEOUT later."""
    try:
        await quit_qemu(qmp_socket, EXIT_TIMEOUT)
    except GuestGoneError:
        pass  # QEMU closed the connection while quitting: what quit does
    except QmpprofError:
        qemu.terminate()
    if await _wait_exit(qemu, EXIT_TIMEOUT) is None:
        qemu.kill()
        qemu.wait()


def main(args: list[str]) -> int:
    flags, command = split_command(args)
    recorded = record(flags, command)
    print(end_line(command[0], recorded), file=sys.stderr)
    return 0


def end_line(program: str, recorded: Recorded) -> str:
    name = Path(program).name
    if recorded.exit_status is None:
        return f"qmpprof: stopped {name}"
    return f"qmpprof: {name} exited ({describe_status(recorded.exit_status)}); profiled until then"
