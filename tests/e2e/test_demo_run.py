"""``qmpprof demo`` run for real (a subprocess in a fresh directory): it must leave demo.svg and
demo.folded holding the bundled guest's workload functions (fixtures/guest/expected.json), for
the x86_64 build and the i386 ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from guestvm import build_fixtures, expected
from qemus import every_qemu

from qmpprof.output import folded

RUN_TIMEOUT = 180.0  # boot, 2 s of guest run time and the pauses, on a loaded 2-core host


def workload_functions() -> set[str]:
    """Every function of the guest's workload stacks (expected.json), as folded names."""
    spec = expected()
    names = set(spec["kernel_threads"]["kworker"]["shares"])
    for program in spec["programs"].values():
        names |= set(program["shares"])
    # Kernel frames carry the _[k] mark: the kernel thread's and the system call's.
    kernel_side = set(spec["syscall_path"]) | set(spec["kernel_threads"]["kworker"]["shares"])
    return {f"{n}_[k]" if n in kernel_side else n for n in names}


@pytest.mark.qemu
@every_qemu
def test_demo_writes_the_flame_graph_and_folded_stacks_here(tmp_path: Path) -> None:
    build_fixtures()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qmpprof", "demo", "--duration", "2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its QEMU too: killed whole should the test fail half-way
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    svg, folded_file = tmp_path / "demo.svg", tmp_path / "demo.folded"
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))
    seen = {name for names, _ in folded.parse(folded_file.read_text()) for name in names}
    assert workload_functions() <= seen, sorted(workload_functions() - seen)
    assert out.startswith("Hottest functions (")
    assert f"Flame graph: {svg.as_uri()}" in out
    assert "Traceback" not in err


@pytest.mark.qemu
@every_qemu
@pytest.mark.parametrize("variant", ["i386", "i386-pae"])
def test_demo_takes_the_i386_builds(tmp_path: Path, variant: str) -> None:
    """``--variant i386`` (and ``i386-pae``, with PAE paging): the 32-bit build in
    qemu-system-i386, processes told apart by CR3."""
    build_fixtures((variant,))
    command = [sys.executable, "-m", "qmpprof", "demo", "--variant", variant, "--duration", "2"]
    proc = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    stacks = folded.parse((tmp_path / "demo.folded").read_text())
    seen = {name for names, _ in stacks for name in names}
    assert workload_functions() <= seen, sorted(workload_functions() - seen)
    assert any(names[0].startswith("spin (cr3=") for names, _ in stacks)
    assert out.startswith("Hottest functions (")
