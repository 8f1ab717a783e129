"""The teaching-kernel-shaped guests (fixtures/hobby, hobby64) on every QEMU: their own tables say
what its sources promise (three processes, crunch, chatter, chatter, with pids 1-3; both CPUs found
and started, each one's current process one of them or none, never the same on both), and a run with
no flag but --kernel and --user-dir splits kernel from user where the kernel's ELF says, each stack
whole down to its program's ``_start``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from guestvm import free_tcp_port, run_gdb
from hobbyvm import SMP, Hobby, every_hobby, running_hobby
from qemus import every_qemu

from qmpprof.cli import main
from qmpprof.model import Mode
from qmpprof.output import native

pytestmark = [pytest.mark.qemu, every_qemu, every_hobby]

_PROC = re.compile(r'^proc (\d+) "(\w*)" (\w+)$', re.MULTILINE)
_CURRENT = re.compile(r"^current (\d+) (-?\d+) (\d+)$", re.MULTILINE)


def test_process_table_as_gdb_reads_it(tmp_path: Path, hobby: Hobby) -> None:
    with running_hobby(tmp_path, hobby, gdb_port=free_tcp_port()) as guest:
        procs, cpus = (
            hobby.names.procs,
            hobby.names.cpus,
        )  # C's globals, or Rust's statics quoted whole
        commands = ["set language c"]
        commands += [
            f'printf "proc %d \\"%s\\" %d\\n", {procs}[{i}].pid, (char *)&{procs}[{i}].name, '
            f"{procs}[{i}].state"
            for i in range(4)
        ]
        commands += [
            f'printf "current {i} %d %d\\n", {cpus}[{i}].proc ? {cpus}[{i}].proc - {procs} : -1, '
            f"{cpus}[{i}].started"
            for i in range(SMP)
        ]
        commands.append(f'printf "ncpu %d\\n", {hobby.names.ncpu}')
        output = run_gdb(guest, None, commands)
    procs = _PROC.findall(output)
    assert [(pid, name) for pid, name, _ in procs] == [
        ("1", "crunch"), ("2", "chatter"), ("3", "chatter"), ("0", ""),
    ], output  # fmt: skip
    assert f"ncpu {SMP}\n" in output, output
    current = _CURRENT.findall(output)
    assert [(cpu, started) for cpu, _, started in current] == [(str(i), "1") for i in range(SMP)]
    running = [int(proc) for _, proc, _ in current if proc != "-1"]
    assert set(running) <= {0, 1, 2} and len(set(running)) == len(running), output


def test_the_kernel_boundary_is_read_from_the_elf(
    tmp_path: Path, hobby: Hobby, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.qmpprof"
    with running_hobby(tmp_path, hobby) as guest:
        files = ["--kernel", str(guest.kernel_elf), "--user-dir", str(guest.user_dir)]
        run = ["--qmp-socket", str(guest.qmp_socket), *files, "--duration", "0.5", "-v"]
        code = main([*run, "-o", str(out)])
        read = capsys.readouterr().err
        # The control: the instruction set's default split is wrong for this kernel.
        assert main([*run, "--kernel-boundary", "0xc0000000"]) == 0
        guessed = capsys.readouterr().err
    assert code == 0, read
    # The sampler counts every sample whose pc's side of the boundary is not the CPU's mode.
    assert "disagreed with the kernel boundary" not in read, read
    assert "disagreed with the kernel boundary" in guessed, guessed
    profile = native.load(out)
    assert profile.facts["kernel boundary"] == f"{hobby.boundary:#x}"
    # chatter's system calls and crunch's loops: both sides are sampled.
    assert len(profile.select(Mode.KERNEL)) > 0 and len(profile.select(Mode.USER)) > 0
    # A stack that reaches a program's entry point (_start, which nothing calls) is whole.
    at_start = [
        record.truncated
        for record, count in zip(profile.stacks, profile.counts, strict=True)
        if count and record.frames and profile.frames[record.frames[-1]].symbol == "_start"
    ]
    assert at_start and not any(at_start), at_start
