"""qmpprof's command line: ``main(argv) -> exit code``.

``qmpprof record|demo|report|diff|serve ...`` dispatch to their own modules; anything else is the
profiling command (cli/sample.py). Every command runs under ``guarded``: every error ends as one
line on stderr, ``qmpprof: error: ...``, and the exit code of its class in qmpprof.errors;
never a traceback. Ctrl-C outside sampling (connecting, loading files) exits 130.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Callable
from typing import cast

from qmpprof.errors import GuestGoneError, QmpprofError

SUBCOMMANDS = ("record", "demo", "report", "diff", "serve")
EXIT_INTERRUPTED = 130

Command = Callable[[list[str]], int]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in SUBCOMMANDS:
        module = importlib.import_module(f"qmpprof.cli.{args[0]}")
        return guarded(cast(Command, module.main), args[1:])
    return guarded(_profile, args)


def guarded(command: Command, args: list[str]) -> int:
    try:
        return command(args)
    except SystemExit as exit_:  # -h, --version
        return exit_.code if isinstance(exit_.code, int) else 0
    except (KeyboardInterrupt, asyncio.CancelledError):
        # A first Ctrl-C during sampling is a clean stop (cli/sample.py); this is one before
        # sampling starts, or a second one while QEMU does not answer.
        print("qmpprof: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except QmpprofError as err:
        print(f"qmpprof: error: {err}", file=sys.stderr)
        return err.exit_code


def _profile(args: list[str]) -> int:
    from qmpprof.cli import options, sample

    opts = options.parse(args)
    try:
        return asyncio.run(sample.run(opts))
    except GuestGoneError as err:
        raise GuestGoneError(sample.gone_message(err, opts.outputs)) from err
