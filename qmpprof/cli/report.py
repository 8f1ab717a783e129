"""``qmpprof report PROFILE``: render a saved profile (``.qmpprof``, or a pprof ``.pb.gz``)
again, in any format, any naming, for some modes or vCPUs. Without ``-o`` it prints the top
stacks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import qmpprof.cli.options as options
import qmpprof.cli.outputs as outputs
import qmpprof.cli.text as text
import qmpprof.output.native as native


def parser() -> argparse.ArgumentParser:
    p = options.Parser(
        prog="qmpprof report",
        description="Render a profile saved as .qmpprof (or a pprof .pb.gz) again: any format, "
        "any naming.",
        epilog="Example: qmpprof report run.qmpprof -o run.svg --lines",
    )
    add = p.add_argument
    add("profile", metavar="PROFILE", help="a profile saved as .qmpprof, or a pprof .pb.gz")
    add("-o", "--output", metavar="FILE", action="append", default=[],
        help="write it here, in the format its name implies (repeatable); else print the top "
             "stacks")  # fmt: skip
    add("--format", metavar="FMT", help="output format (default: from the file name)")
    options.add_view_flags(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--on-cpu", action="store_true", help="only the samples on a CPU")
    where.add_argument(
        "--off-cpu", action="store_true", help="only the samples of tasks off CPU (--off-cpu runs)"
    )
    return p


def main(args: list[str]) -> int:
    ns = parser().parse_args(args)
    paths = options.outputs_of(ns)
    keep = options.mode_of(ns)
    outputs.check(paths, ns.format)
    profile = native.load(Path(ns.profile))
    on_cpu = True if ns.on_cpu else False if ns.off_cpu else None
    if keep is not None or ns.cpus or on_cpu is not None:
        cpus = options.parse_cpus(ns.cpus) if ns.cpus else None
        profile = profile.select(keep, cpus, on_cpu)
    naming = options.naming_of(ns)
    if not paths:
        sys.stdout.write(text.top_stacks(profile, naming))
    for path in paths:
        fmt = outputs.write(profile, path, ns.format, naming, sys.stdout)
        print(text.written_line(path, fmt), file=sys.stderr)
    return 0
