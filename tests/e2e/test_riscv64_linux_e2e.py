"""qmpprof on the riscv64 test guest (trixie's riscv64 6.12 on 2 vCPUs under qemu-system-riscv64,
TCG) as Linux, chosen by itself from ``--kernel`` (the -dbg vmlinux, no ``--os``): at MOMENTS
random moments gdb-multiarch stops the guest and qmpprof samples it as it is (a paused guest is
sampled without stop/cont, over QMP: gdb holds the gdbstub), and each vCPU's process, as
qmpprof names it, is compared with what gdb reads of the current task at the same stop: its
comm, tgid and pid. Then, the guest paused by gdb with both vCPUs in user mode (where no vCPU
reads the kernel's variables), qmpprof attaches and samples once: its page tables found, each
vCPU's process named as gdb reads it.

gdb's reading: the task is tp where tp holds a kernel address, else sscratch (Linux's riscv64
entry code swaps them: arch/riscv/kernel/entry.S), read through DWARF's ``struct task_struct``,
through whichever vCPU reads kernel memory (one in M-mode firmware, OpenSBI, translates
nothing, one in user mode no supervisor page), else physically through the linear map
(``kernel_map.va_pa_offset``, read once through a vCPU in S-mode). A vCPU whose task gdb reads
in neither way is not compared, and counted.

Only on the host's QEMU, as tests/e2e/test_riscv64_e2e.py: scripts/fetch-qemu's unstable tree
has no qemu-system-riscv64 yet.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gdbmoments import Observed, observed, stopped_moment
from guestvm import free_tcp_port, run_state
from riscv64vm import Riscv64Guest, running_riscv64_guest, vmlinux_dbg
from support.bench.gdbcli import GdbMi

from qmpprof import session
from qmpprof.linux.running.guest import LinuxGuest
from qmpprof.sampler import Sampler
from qmpprof.transport.base import Reach

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

MOMENTS = 100
REQUIRED = 0.99  # of the vCPUs' processes compared: equal to gdb's (issue 33)
UNREAD = 0.1  # at most this share of the vCPUs' tasks unread by gdb (every vCPU in firmware)
WORKLOAD = {"xz", "init"}  # the workload's compressor and its shell loops (PID 1's children)
USER_PAUSE_WAIT = 60.0  # seconds of stops until one finds both vCPUs in user mode

SCRIPT = r"""
import gdb, json

QG_VA_PA = None  # kernel_map.va_pa_offset: the linear map's offset from physical memory

def _reg(name):
    return int(gdb.parse_and_eval("$" + name)) & (2**64 - 1)

QG_OFFSETS = {}  # task_struct's members' offsets, read once

def _offset(member):
    if member not in QG_OFFSETS:
        QG_OFFSETS[member] = int(
            gdb.parse_and_eval("(unsigned long)&((struct task_struct *)0)->" + member))
    return QG_OFFSETS[member]

def _fields(read, task):
    pid, tgid, comm = (_offset(m) for m in ("pid", "tgid", "comm"))
    number = lambda at: int.from_bytes(read(task + at, 4), "little", signed=True)
    return [number(pid), number(tgid), read(task + comm, 16).split(b"\0")[0].hex()]

def _virtual(addr, size):
    return bytes(gdb.selected_inferior().read_memory(addr, size))

def _physical(addr, size):
    return bytes(gdb.selected_inferior().read_memory(addr - QG_VA_PA, size))

def _read_task(task, threads):
    if task < 1 << 63:
        return None  # neither tp nor sscratch holds a task: a vCPU in OpenSBI (M-mode), whose
                     # trap entry swaps tp for its scratch (fw_base.S), sscratch 0 in S-mode
    for thread in threads:
        gdb.execute("thread %d" % thread, to_string=True)
        try:
            return _fields(_virtual, task)
        except gdb.MemoryError:
            continue
    if QG_VA_PA is None:
        return None
    # No vCPU in S-mode: read through the linear map physically (QEMU's gdbstub).
    gdb.execute("maintenance packet Qqemu.PhyMemMode:1", to_string=True)
    try:
        return _fields(_physical, task)
    except gdb.MemoryError:
        return None
    finally:
        gdb.execute("maintenance packet Qqemu.PhyMemMode:0", to_string=True)

def qg_riscv64_layout(count):
    global QG_VA_PA
    for thread in range(1, count + 1):
        gdb.execute("thread %d" % thread, to_string=True)
        try:
            QG_VA_PA = int(gdb.parse_and_eval("kernel_map.va_pa_offset")) & (2**64 - 1)
            break
        except gdb.MemoryError:
            continue
    print("QGRV %d" % (QG_VA_PA is not None))

def qg_riscv64_modes(count):
    modes = []
    for thread in range(1, count + 1):
        gdb.execute("thread %d" % thread, to_string=True)
        modes.append(_reg("priv"))
    print("QGRV " + json.dumps(modes).encode().hex())

def qg_riscv64(count):
    threads = range(1, count + 1)
    held = []
    for thread in threads:
        gdb.execute("thread %d" % thread, to_string=True)
        tp = _reg("tp")
        held.append(tp if tp >= 1 << 63 else _reg("sscratch"))
    out = [[task, _read_task(task, threads)] for task in held]
    print("QGRV " + json.dumps(out).encode().hex())
"""


class Riscv64TaskOracle(GdbMi):
    """gdb-multiarch on the -dbg vmlinux (the kernel has no KASLR: its link addresses are the
    running ones), attached to the guest's gdbstub."""

    program = "gdb-multiarch"
    timeout = 240.0  # reading the vmlinux's DWARF on a loaded host

    def __init__(self, port: int, script: Path) -> None:
        super().__init__(str(vmlinux_dbg()))
        script.write_text(SCRIPT)
        self.command(f'-interpreter-exec console "source {script}"')
        self.attach(f"127.0.0.1:{port}")

    def stop_guest(self) -> None:
        lines = self.command("-exec-interrupt")
        if not any(line.startswith("*stopped") for line in lines):
            self._until(lambda line: line.startswith("*stopped"))

    def resume(self) -> None:
        self.command("-exec-continue")

    def layout(self, count: int) -> bool:
        """Read the linear map's offset through a vCPU in S-mode; False if none is."""
        return self._answer(f"qg_riscv64_layout({count})") == "1"

    def _answer(self, call: str) -> str:
        lines = self.command(f'-interpreter-exec console "python {call}"')
        return next(line[7:-3] for line in lines if line.startswith('~"QGRV '))

    def modes(self, count: int) -> list[int]:
        """Each vCPU's privilege mode (QEMU's ``priv`` register: 0 user, 1 supervisor, 3
        machine)."""
        return list(json.loads(bytes.fromhex(self._answer(f"qg_riscv64_modes({count})"))))

    def tasks(self, count: int) -> list[tuple[int, tuple[int, int, str] | None]]:
        """Each vCPU's current task: its address, and (pid, tgid, comm) or None (unread)."""
        found = json.loads(bytes.fromhex(self._answer(f"qg_riscv64({count})")))
        return [
            (task, None if read is None else (read[0], read[1], bytes.fromhex(read[2]).decode()))
            for task, read in found
        ]


@dataclass
class Processes:
    compared: int = 0
    equal: int = 0
    unread: int = 0  # vCPUs whose task gdb could not read
    kernel_mode: int = 0  # of the compared, in kernel mode
    names: Counter[str] = field(default_factory=Counter)  # gdb's comms, compared
    wrong: list[str] = field(default_factory=list)
    # The one-shot attached with every vCPU in user mode: ours and gdb's, each vCPU
    user_paused: list[tuple[Observed, tuple[int, tuple[int, int, str] | None]]] = field(
        default_factory=list
    )
    user_paused_tables: bool = False  # whether that attach found the page tables

    def add(self, ours: Observed, theirs: tuple[int, tuple[int, int, str] | None]) -> None:
        task, read = theirs
        if read is None:
            self.unread += 1
            return
        pid, tgid, comm = read
        self.compared += 1
        self.kernel_mode += ours.kernel_mode
        self.names[comm] += 1
        # qmpprof's Process: (pid = tgid, program, tid = the task's pid, thread = its comm).
        seen = None if ours.process is None else (ours.process[3], ours.process[0], ours.process[2])
        if seen == (comm, tgid, pid):
            self.equal += 1
        else:
            self.wrong.append(
                f"cpu {ours.cpu} task {task:#x}: gdb {(comm, tgid, pid)}, ours {seen}"
            )


@pytest.fixture(scope="module")
def guest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Riscv64Guest, int]]:
    if shutil.which("gdb-multiarch") is None:
        pytest.fail("no gdb-multiarch on PATH (scripts/setup installs it)")
    port = free_tcp_port()
    with running_riscv64_guest(tmp_path_factory.mktemp("riscv64"), gdb_port=port) as booted:
        yield booted, port


async def compare(guest: Riscv64Guest, port: int, script: Path) -> Processes:
    rng = random.Random("qmpprof-riscv64-linux-e2e")
    tally = Processes()
    oracle = Riscv64TaskOracle(port, script)
    try:
        while True:  # the moments where no vCPU runs the kernel need the linear map
            oracle.stop_guest()
            ready = oracle.layout(2)
            oracle.resume()
            if ready:
                break
        spec = session.RunSpec(reach=Reach(guest.qmp_socket, transport="qmp"), kernel=vmlinux_dbg())
        linux = session.load(spec)
        assert isinstance(linux, LinuxGuest), linux  # chosen by itself: no --os
        assert linux.platform.name == "riscv64"
        run = await session.start(spec, guest=linux)
        try:
            for _ in range(MOMENTS):
                seen = await stopped_moment(oracle, run, rng)  # type: ignore[arg-type]
                for ours, theirs in zip(seen, oracle.tasks(len(seen)), strict=True):
                    tally.add(ours, theirs)
                oracle.resume()
                await linux.housekeep()
        finally:
            await run.transport.close()
        await one_shot_in_user_mode(oracle, spec, linux, tally)
    finally:
        oracle.close()
    return tally


async def one_shot_in_user_mode(
    oracle: Riscv64TaskOracle, spec: session.RunSpec, linux: LinuxGuest, tally: Processes
) -> None:
    """Attached to the guest paused with every vCPU in user mode (no vCPU reads the kernel's
    variables then: no housekeeping comes before a one-shot's sample), a one-shot names each
    vCPU's process as gdb reads it (``tally.user_paused``)."""
    deadline = time.monotonic() + USER_PAUSE_WAIT
    while True:  # stop, look, go on: no sleep (the workload is in user mode most of the time)
        oracle.stop_guest()
        if all(mode == 0 for mode in oracle.modes(2)):
            break
        oracle.resume()
        assert time.monotonic() < deadline, "never paused with both vCPUs in user mode"
    run = await session.start(spec, guest=linux)
    try:
        spaces = linux.identifier.spaces
        tally.user_paused_tables = spaces is not None and spaces.tables is not None
        outcome = await Sampler(run.transport, run.unwinder, run.identifier, run.config).run(
            one_shot=True
        )
        assert not outcome.was_running
        ours = [observed(sample) for sample in outcome.last]
        for one, theirs in zip(ours, oracle.tasks(len(ours)), strict=True):
            tally.user_paused.append((one, theirs))
    finally:
        await run.transport.close()
        oracle.resume()


def test_processes_are_the_current_task_gdb_reads(
    guest: tuple[Riscv64Guest, int], tmp_path: Path
) -> None:
    booted, port = guest
    tally = asyncio.run(compare(booted, port, tmp_path / "qg.py"))
    assert run_state(booted.qmp_socket) == "running"
    print(
        f"\nriscv64: processes equal to gdb's {tally.equal}/{tally.compared}"
        f" ({tally.kernel_mode} in kernel mode), unread by gdb {tally.unread};"
        f" gdb's comms {tally.names.most_common(8)}"
    )
    print(*tally.wrong[:20], sep="\n")
    assert tally.compared >= MOMENTS, tally.compared
    assert tally.unread <= UNREAD * (tally.compared + tally.unread), tally.unread
    assert 0 < tally.kernel_mode < tally.compared, tally.kernel_mode  # both modes compared
    assert set(tally.names) >= WORKLOAD, tally.names
    assert tally.equal >= REQUIRED * tally.compared, "\n".join(tally.wrong)
    # Attached paused with both vCPUs in user mode: the page tables found, and each vCPU's
    # process named as gdb reads the current task.
    paused = [(ours.kernel_mode, ours.process, theirs) for ours, theirs in tally.user_paused]
    print(f"attached in user mode: {paused}, page tables {tally.user_paused_tables}")
    assert tally.user_paused_tables
    assert len(paused) == 2 and not any(kernel for kernel, _, _ in paused), paused
    for _, process, (_, read) in paused:
        assert read is not None, paused  # gdb reads it physically (the map read at the start)
        assert process is not None and (process[3], process[0], process[2]) == (
            read[2],
            read[1],
            read[0],
        ), paused
