"""What the profiling command imports before it connects: the guest OS, the instruction set's
code reader, the output format and debuginfod's HTTP client each come with the run that uses
them, not with every start (a user pays the start-up on each ``qmpprof --one-shot``). Read in a
new interpreter, as the command starts; the time it takes is scripts/bench's
(``startup_ratio``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The command up to its first look at the socket (a missing one: nothing is connected), with
# an output whose writer it must not load yet; then ``--os auto`` choosing for a run without a
# kernel file, which asks Linux first.
START = """
import json, sys
from qmpprof.cli import main
code = main(["--qmp-socket", sys.argv[1], "-o", "profile.svg"])
from qmpprof.guest import registry
chosen = registry.choose("auto", None).name
print(json.dumps({"code": code, "chosen": chosen, "modules": sorted(sys.modules)}))
"""
# Imported by the runs that use them alone (each a module the start-up must not reach).
LATER = (
    "qmpprof.linux.kernel",  # a Linux kernel file's readers: a run with --kernel
    "qmpprof.linux.running.kernels",  # Linux chosen
    "qmpprof.linux.running.guest",
    "qmpprof.elf.debuginfod",  # --lines on a kernel without DWARF
    "http.client",
    "qmpprof.output.svg",  # a profile written in that format
    "qmpprof.output.pprof",
    "qmpprof.output.native",
    "qmpprof.output.speedscope",
    "qmpprof.output.folded",
    "capstone",  # the first walk through code with no CFI
    "qmpprof.transport.libvirtdomain",  # --domain
)


def started(tmp_path: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", START, str(tmp_path / "no-socket")],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    found: dict[str, object] = json.loads(out.stdout)
    assert "no QMP socket at" in out.stderr, out.stderr
    return found


def test_the_command_starts_without_what_its_run_does_not_use(tmp_path: Path) -> None:
    found = started(tmp_path)
    modules = found["modules"]
    assert isinstance(modules, list)
    # It did start: the command's own modules, the registries', and the check that failed.
    assert found["code"] == 3 and found["chosen"] == "emerald", found
    assert {"qmpprof.cli.sample", "qmpprof.session", "qmpprof.output", "asyncio"} <= set(modules)
    assert "qmpprof.linux.running.linuxos" in modules  # the registry's entry for Linux
    assert [m for m in LATER if m in modules] == []
    linux = [m for m in modules if m.startswith("qmpprof.linux.")]
    assert linux == ["qmpprof.linux.running", "qmpprof.linux.running.linuxos"]
