"""qmpprof's command line: ``main(argv) -> exit code``.

``qmpprof record|demo|report|diff|serve ...`` dispatch to their own modules; anything else is the
profiling command (cli/sample.py). Every command runs under ``guarded``: every error ends as one
line on stderr, ``qmpprof: error: ...``, and the exit code of its class in qmpprof.errors;
never a traceback. SIGINT and SIGTERM are handled from main's first line (qmpprof.interrupts):
one that ends a command before it could finish on its own exits 128 + its number (130, 143)
with one line; a run that was sampling stops, writes what it has and exits 0 (cli/sample.py).
Nothing heavy is imported before the handlers are in place.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import cast

from qmpprof.cli.commands import SUBCOMMANDS
from qmpprof.errors import QmpprofError, UsageError
from qmpprof.interrupts import Interrupted, installed

EXIT_INTERRUPTED = 130  # a KeyboardInterrupt that is not one of our signals' (SIGINT's status)

Command = Callable[[list[str]], int]


def main(argv: list[str] | None = None) -> int:
    """``argv`` None: the program's own arguments, and signals stay ignored after it returns,
    while Python exits; a caller's ``argv`` (tests) gets its handlers back."""
    try:
        with installed(restore=argv is not None):
            return guarded(_dispatch, sys.argv[1:] if argv is None else list(argv))
    except Interrupted as signal:  # between the handlers' start and guarded's own try
        return _interrupted(signal)


def _dispatch(args: list[str]) -> int:
    if args and args[0] in SUBCOMMANDS:
        return _command(args[0], args[1:])
    if args and not args[0].startswith("-"):  # the bare command takes no word of its own
        return _unknown(args)
    return _profile(args)


def _interrupted(signal: Interrupted) -> int:
    print(f"qmpprof: interrupted by {signal}", file=sys.stderr)
    return signal.exit_code


def _command(name: str, args: list[str]) -> int:
    module = importlib.import_module(f"qmpprof.cli.{name}")
    return cast(Command, module.main)(args)


def guarded(command: Command, args: list[str]) -> int:
    try:
        return command(args)
    except SystemExit as exit_:  # -h, --version
        return exit_.code if isinstance(exit_.code, int) else 0
    except Interrupted as signal:
        # A signal before the run touched QEMU (parsing, loading files), or a second one while
        # QEMU does not answer; one during sampling is a clean stop (cli/sample.py).
        return _interrupted(signal)
    except KeyboardInterrupt:
        print("qmpprof: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except QmpprofError as err:
        print(f"qmpprof: error: {err}", file=sys.stderr)
        return err.exit_code


def _unknown(args: list[str]) -> int:
    import difflib  # imported here: only a mistyped command needs it

    near = difflib.get_close_matches(args[0], SUBCOMMANDS, n=1)
    hint = f": did you mean {near[0]}?" if near else ""
    raise UsageError(
        f"unknown command {args[0]!r}{hint} (commands: {', '.join(SUBCOMMANDS)}; with none, "
        "qmpprof profiles a running guest: qmpprof --help)"
    )


def _profile(args: list[str]) -> int:
    import asyncio
    import dataclasses

    import qmpprof.cli.options as options
    import qmpprof.cli.outputs as outputs
    import qmpprof.cli.sample as sample
    from qmpprof.session import check_socket, load, with_boot_files

    # The order a mistake is told in: the flags' values, the socket, the outputs, the files;
    # the cheap checks first, and all before the guest is touched.
    opts = options.parse(args)
    spec = opts.spec
    if spec.reach.transport != "gdb" and spec.reach.qmp_tcp is None and spec.reach.domain is None:
        check_socket(spec.reach.qmp_socket)
    outputs.check(opts.outputs, opts.fmt)
    options.check_files(spec)
    spec, notes = with_boot_files(spec)
    for note in notes:
        sys.stderr.write(f"qmpprof: note: {note}\n")
    opts = dataclasses.replace(opts, spec=spec)
    guest = load(spec)  # before the loop: a signal now has nothing to undo
    return asyncio.run(sample.run(opts, guest))
