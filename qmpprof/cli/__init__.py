"""qmpprof's command line: ``main(argv) -> exit code``.

``qmpprof record ...`` and ``qmpprof demo ...`` dispatch to their own modules; anything else is
the profiling command (cli/profile.py). Every error ends as one line on stderr,
``qmpprof: error: ...``, and the exit code of its class in qmpprof.errors; never a traceback.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Callable
from typing import cast

from qmpprof.errors import GuestGoneError, QmpprofError, UsageError

SUBCOMMANDS = ("record", "demo")
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"qmpprof.cli.{args[0]}")
        except ModuleNotFoundError as err:
            if err.name != f"qmpprof.cli.{args[0]}":
                raise
            print(f"qmpprof: error: no '{args[0]}' command in this build", file=sys.stderr)
            return UsageError.exit_code
        return cast(Callable[[list[str]], int], module.main)(args[1:])
    try:
        return _profile(args)
    except (KeyboardInterrupt, asyncio.CancelledError):
        # Ctrl-C before sampling starts (connecting, loading ELF files), or a second one while
        # QEMU does not answer: a first one during sampling is a clean stop (cli/profile.py).
        print("qmpprof: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _profile(args: list[str]) -> int:
    from qmpprof.cli import options, profile

    opts = None
    try:
        opts = options.parse(args)
        return asyncio.run(profile.run(opts))
    except GuestGoneError as err:
        message = profile.gone_message(err, opts.output if opts else None)
        print(f"qmpprof: error: {message}", file=sys.stderr)
        return err.exit_code
    except QmpprofError as err:
        print(f"qmpprof: error: {err}", file=sys.stderr)
        return err.exit_code
