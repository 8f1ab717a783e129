"""``qmpprof demo``: boot the bundled guest, profile it, show the result.

The bundled guest (fixtures/guest, a small SMP kernel with user processes) is found in the
source checkout this package runs from, else in the current directory or one above it, and
built with scripts/build-fixtures when its build is missing. It boots under ``qmpprof record``
(the QEMU command line of scripts/run-guest, console to a private file) with the kernel ELF and
the user programs as symbol sources; the flame graph (``demo.svg``) and the folded stacks next to
it (``demo.folded``) land in the current directory. Then the hottest functions and a file://
URL of the flame graph are printed, and the guest is stopped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import qmpprof.cli.record as record
from qmpprof.cli.options import Parser
from qmpprof.errors import GuestGoneError, QmpprofError, UsageError
from qmpprof.naming import Naming
from qmpprof.output import write_profile
from qmpprof.profile import Profile

QEMU = "qemu-system-x86_64"
# The binary for each build: the i386 builds boot in qemu-system-i386 (scripts/run-guest's).
QEMU_OF = {"fp": QEMU, "cfi": QEMU, "i386": "qemu-system-i386", "i386-pae": "qemu-system-i386"}
MAX_SMP = 4  # what the bundled kernel supports
TOP = 10


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="qmpprof demo",
        description="Boot the bundled guest OS in QEMU, profile it, write a flame graph.",
    )
    add = p.add_argument
    add("--variant", choices=tuple(QEMU_OF), default="cfi",
        help="guest build: frame pointers (fp), CFI in .eh_frame (cfi, the default), or the "
             "32-bit build (i386, in qemu-system-i386; i386-pae: with PAE paging)")  # fmt: skip
    add("--smp", metavar="N", type=int, default=1, help=f"vCPUs, 1..{MAX_SMP} (default 1)")
    add("--duration", metavar="S", type=float, default=5.0,
        help="guest run time to profile (default 5)")  # fmt: skip
    add("-o", "--output", metavar="FILE", default="demo.svg",
        help="flame graph to write (default demo.svg); FILE.folded goes next to it")  # fmt: skip
    return p


def find_checkout(start: Path | None = None) -> Path:
    """The source checkout holding the bundled guest: this package's, else ``start`` (the
    current directory) or one of its parents."""
    here = (start or Path.cwd()).resolve()
    for candidate in (Path(__file__).resolve().parents[2], here, *here.parents):
        if (candidate / "fixtures" / "guest" / "Makefile").is_file():
            return candidate
    raise QmpprofError(
        "cannot find the bundled guest (fixtures/guest): run qmpprof demo in a qmpprof checkout"
    )


def ensure_built(checkout: Path, variant: str, err: TextIO) -> Path:
    """fixtures/build/<variant>, built first when its kernel or user programs are missing."""
    build = checkout / "fixtures" / "build" / variant
    if (build / "kernel.elf").is_file() and any((build / "user").glob("*.elf")):
        return build
    script = checkout / "scripts" / "build-fixtures"
    print(f"qmpprof: building the bundled guest ({script})", file=err, flush=True)
    try:
        # make's output goes to stderr (file descriptor 2): stdout is for the demo's result.
        env = dict(os.environ, QMPPROF_GUEST_VARIANTS=variant)  # that build alone
        done = subprocess.run([script], stdout=2, check=False, env=env)
    except OSError as error:
        raise QmpprofError(f"cannot run {script}: {error.strerror}") from None
    if done.returncode != 0 or not (build / "kernel.elf").is_file():
        raise QmpprofError(f"building the bundled guest failed ({script} exited {done.returncode})")
    return build


def qemu_command(qemu: str, kernel: Path, smp: int, console: Path) -> list[str]:
    """scripts/run-guest's QEMU command line (record adds -S and its QMP socket)."""
    serial = f"file:{str(console).replace(',', ',,')}"
    return [
        qemu, "-kernel", str(kernel), "-accel", "tcg", "-smp", str(smp), "-m", "128M",
        "-display", "none", "-no-reboot", "-monitor", "none", "-serial", serial,
    ]  # fmt: skip


def folded_path(svg: Path) -> Path:
    folded = svg.with_suffix(".folded")
    if folded == svg:
        raise UsageError(f"-o names the SVG flame graph (e.g. demo.svg), not {svg}")
    return folded


def hottest(profile: Profile, n: int = TOP) -> str:
    """The functions that were running (the leaf of the stack) most often."""
    total = len(profile)
    if not total:
        return "No samples.\n"
    lines = [f"Hottest functions ({total} samples in the function itself; _[k]: kernel code):"]
    lines += [f"{c:7d} {c / total:6.1%}  {name}" for name, c in profile.top_functions(Naming(), n)]
    return "\n".join(lines) + "\n"


def run(argv: list[str], out: TextIO, err: TextIO) -> int:
    ns = parser().parse_args(argv)
    if not 1 <= ns.smp <= MAX_SMP:
        raise UsageError(f"--smp must be 1..{MAX_SMP} (what the bundled kernel supports)")
    svg = Path(ns.output)
    folded = folded_path(svg)
    binary = QEMU_OF[ns.variant]
    qemu = shutil.which(binary)
    if qemu is None:
        raise QmpprofError(
            f"{binary} not found: install QEMU (Debian: apt-get install qemu-system-x86)"
        )
    build = ensure_built(find_checkout(), ns.variant, err)
    flags = ["--kernel", str(build / "kernel.elf"), "--user-dir", str(build / "user"),
             "--duration", str(ns.duration), "-o", str(svg), "--format", "svg"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="qmpprof-demo-") as workdir:
        console = Path(workdir, "console.txt")
        command = qemu_command(qemu, build / "kernel.elf", ns.smp, console)
        label = f"bundled guest ({ns.variant} build, {ns.smp} vCPU{'s' if ns.smp > 1 else ''})"
        recorded = record.record(flags, command, label=label)
        if recorded.exit_status is not None:
            # The bundled guest never powers off: QEMU ending means it crashed.
            lines = console.read_text(errors="replace").splitlines() if console.exists() else []
            last = f"; its console said: {lines[-1]}" if lines else ""
            status = record.describe_status(recorded.exit_status)
            raise GuestGoneError(f"QEMU exited early ({status}){last}")
    write_profile(recorded.profile, folded, "folded")
    err.write(f"Wrote {folded} (folded)\n")
    out.write(hottest(recorded.profile))
    out.write(f"\nFlame graph: {svg.resolve().as_uri()}  (open it in a web browser)\n")
    return 0


def main(args: list[str]) -> int:
    return run(args, sys.stdout, sys.stderr)
