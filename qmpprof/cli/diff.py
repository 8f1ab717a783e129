"""``qmpprof diff BEFORE AFTER``: two saved profiles (``.qmpprof``) compared, as a differential
flame graph (``.svg``) or two-column folded stacks (``.folded``), in any naming, for some modes
or vCPUs. Without ``-o`` it prints the functions whose share changed most."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import qmpprof.cli.outputs as outputs
import qmpprof.cli.text as text
import qmpprof.output.diff as diff
import qmpprof.output.native as native
from qmpprof.cli.options import (
    Parser,
    add_view_flags,
    mode_of,
    naming_of,
    outputs_of,
    parse_cpus,
)
from qmpprof.naming import Naming
from qmpprof.output import write_atomic
from qmpprof.profile import Profile

WRITERS = ("folded", "svg")


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="qmpprof diff",
        description="Compare two profiles saved as .qmpprof: a differential flame graph (frames "
        "laid out by AFTER, red where a frame's share grew, blue where it shrank) or folded "
        "stacks with both counts.",
        epilog="Example: qmpprof diff old.qmpprof new.qmpprof -o diff.svg",
    )
    add = p.add_argument
    add("before", metavar="BEFORE", help="the baseline profile (.qmpprof or pprof .pb.gz)")
    add("after", metavar="AFTER", help="the profile compared with it (.qmpprof or .pb.gz)")
    add("-o", "--output", metavar="FILE", action="append", default=[],
        help="write the comparison here: FILE.svg or FILE.folded (repeatable); else print the "
             "functions that changed most")  # fmt: skip
    add("--format", metavar="FMT", choices=WRITERS, help="svg or folded (default: from the name)")
    add_view_flags(p)
    return p


def main(args: list[str]) -> int:
    ns = parser().parse_args(args)
    paths = outputs_of(ns)
    outputs.check(paths, ns.format, WRITERS)
    keep = mode_of(ns)
    cpus = parse_cpus(ns.cpus) if ns.cpus else None
    profiles = []
    for name in (ns.before, ns.after):
        profile = native.load(Path(name))
        if keep is not None or cpus:
            profile = profile.select(keep, cpus)
        profiles.append(profile)
    before, after = profiles
    naming = naming_of(ns)
    if not paths:
        sys.stdout.write(_changes(before, after, naming))
    for path in paths:
        fmt = outputs.chosen_format(path, ns.format)
        if fmt == "svg":
            names = (Path(ns.before).name, Path(ns.after).name)
            data = diff.render_svg(before, after, naming, names)
        else:
            data = diff.render_folded(before, after, naming)
        if path == outputs.STDOUT:
            outputs.emit(data.encode("utf-8"), False, sys.stdout)
        else:
            write_atomic(path, data.encode("utf-8"))
        print(text.written_line(path, fmt), file=sys.stderr)
    return 0


def _changes(before: Profile, after: Profile, naming: Naming) -> str:
    rows = diff.changes(before, after, naming)
    lines = [f"Self samples, before ({len(before)}) and after ({len(after)}), largest change "
             "in share first:"]  # fmt: skip
    lines += [f"{b:7d} {a:7d} {points:+7.2f} pts  {name}" for name, b, a, points in rows]
    return "\n".join(lines) + "\n"
