"""The commands qmpprof takes as its first word; without one, it profiles a running guest. One
list, read by the dispatch (``cli.main``) and the usage line (``cli.options``)."""

from __future__ import annotations

SUBCOMMANDS = ("record", "demo", "report", "diff", "serve", "top")
