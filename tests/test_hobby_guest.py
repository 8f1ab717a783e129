"""The teaching-kernel-shaped guest (fixtures/hobby) boots on every QEMU and its own tables
say what its sources promise: three processes (crunch, chatter, chatter) with pids 1-3, the
CPU's current process one of them or none."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from guestvm import free_tcp_port, run_gdb
from hobbyvm import running_hobby
from qemus import every_qemu

pytestmark = [pytest.mark.qemu, every_qemu]

_PROC = re.compile(r'^proc (\d+) "(\w*)" (\w+)$', re.MULTILINE)
_CURRENT = re.compile(r"^current (-?\d+)$", re.MULTILINE)


def test_process_table_as_gdb_reads_it(tmp_path: Path) -> None:
    with running_hobby(tmp_path, gdb_port=free_tcp_port()) as guest:
        commands = [
            f'printf "proc %d \\"%s\\" %d\\n", procs[{i}].pid, procs[{i}].name, procs[{i}].state'
            for i in range(4)
        ]
        commands.append('printf "current %d\\n", cpus[0].proc ? cpus[0].proc - procs : -1')
        output = run_gdb(guest, None, commands)
    procs = _PROC.findall(output)
    assert [(pid, name) for pid, name, _ in procs] == [
        ("1", "crunch"), ("2", "chatter"), ("3", "chatter"), ("0", ""),
    ], output  # fmt: skip
    assert _CURRENT.findall(output) in (["-1"], ["0"], ["1"], ["2"]), output
