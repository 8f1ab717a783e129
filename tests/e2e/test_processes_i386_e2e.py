"""The i386 build profiled end to end through the command line, under both QEMU binaries: the
workload's split measured through ``qmpprof -o x.folded`` (the default transport: a private
gdbstub, whose register layout differs between the binaries) against the split the guest counted
itself in the same run (tests/guestphases.py), processes told apart by CR3, the system-call path
stitched onto the calling user frames, and every output format written from the same run. The
i386-pae build once, under qemu-system-x86_64 (its 64-bit register layout;
tests/e2e/test_demo_run.py profiles it under qemu-system-i386): its CR3s differ only in bits
5..11."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from guestphases import read_phase_ticks
from guestvm import expected, process_cr3s, running_guest
from test_processes_e2e import bare, program_of, shares_by_root, split_against_guest

from qmpprof.output.folded import parse

pytestmark = pytest.mark.qemu

EXPECTED = expected("i386")
K = "_[k]"


RUNS = [*(("i386", qemu) for qemu in EXPECTED["qemu"]), ("i386-pae", "qemu-system-x86_64")]


@pytest.mark.parametrize(("variant", "qemu"), RUNS, ids=[f"{v}-{q}" for v, q in RUNS])
def test_i386_profile_measures_the_guests_split(tmp_path: Path, variant: str, qemu: str) -> None:
    outs = [tmp_path / name for name in ("x.folded", "x.svg", "x.speedscope.json", "x.pb.gz")]
    with running_guest(tmp_path, variant, qemu=qemu) as guest:
        cmd = [
            sys.executable, "-m", "qmpprof",
            "--qmp-socket", str(guest.qmp_socket),
            "--kernel", str(guest.kernel_elf),
            "--user-dir", str(guest.user_dir),
            "--interval", "2", "--duration", "20", "--jitter", "0.5", "-v",
            *[arg for out in outs for arg in ("-o", str(out))],
        ]  # fmt: skip
        before = read_phase_ticks(guest)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        after = read_phase_ticks(guest)
        processes = process_cr3s(guest).values()
    assert done.returncode == 0, done.stderr
    print(done.stderr)
    stacks = parse(outs[0].read_text())
    by_root = shares_by_root(stacks)
    labels = {program_of(root) for root in by_root}
    assert set(EXPECTED["programs"]) <= labels, sorted(by_root)
    spin_roots = [root for root in by_root if program_of(root) == "spin"]
    assert len(spin_roots) == len(EXPECTED["programs"]["spin"]["pids"]), spin_roots  # by CR3
    # Named by the whole CR3 each process has (i386-pae: bits 5..11 alone tell them apart).
    user_roots = {root for root in by_root if program_of(root) in EXPECTED["programs"]}
    assert user_roots == {f"{name} (cr3={cr3:#x})" for name, cr3 in processes}, sorted(by_root)
    assert "kernel" in by_root  # the kernel thread

    lines = split_against_guest(EXPECTED, by_root, before, after, f"{variant} {qemu}")
    print("\n".join(line for line, _ in lines))
    assert all(held for _, held in lines), "\n".join(line for line, _ in lines)

    # System calls: the kernel chain through int 0x80, on top of sys's user frames.
    entry = f"{EXPECTED['syscall_path'][0]}{K}"
    in_syscall = [f for f, _ in stacks if program_of(f[0]) == "sys" and entry in f]
    assert in_syscall
    for frames in in_syscall:
        assert frames[1 : frames.index(entry)] == ("_start", "main", "sys_call_kernel"), frames
        kernel_part = [bare(f) for f in frames[frames.index(entry) :]]
        assert kernel_part[: len(EXPECTED["syscall_path"])] == EXPECTED["syscall_path"][
            : len(kernel_part)
        ] or any(f.startswith("isr_") for f in kernel_part), frames

    svg = outs[1].read_text()
    assert svg.startswith("<?xml") and "spin_hot" in svg
    speedscope = json.loads(outs[2].read_text())
    names = {frame["name"] for frame in speedscope["shared"]["frames"]}
    assert {"spin_hot", "compute_leaf", "kwork_checksum"} <= {n.removesuffix(K) for n in names}
    assert outs[3].read_bytes()[:2] == b"\x1f\x8b"  # gzipped pprof
