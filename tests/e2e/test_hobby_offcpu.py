"""--off-cpu on the teaching-kernel-shaped guests (fixtures/hobby, hobby64) by their shipped
descriptions (describe.toml beside their sources), on every QEMU and two vCPUs: gdb stops the guest
where a CPU's scheduler wakes the sleepers (holding the process table's lock: no task on the other
CPU changes state meanwhile) until WANTED sleeping tasks were seen; at each, qmpprof lists every
task switched out, and they must be the tasks the guest's own table holds asleep (``procs[i].state``
= SLEEPING, by pid, as many), each kernel stack = the frame-pointer chain gdb reads by hand from
``procs[i].context`` (its pc, then each saved frame pointer's return address), frame for frame."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from guestvm import free_tcp_port
from hobbyvm import Hobby, every_hobby, running_hobby
from qemus import every_qemu
from test_hobby_vs_gdb import HobbyOracle

from qmpprof import offcpu, session
from qmpprof.session import RunSpec
from qmpprof.transport.qmp import QmpTransport

pytestmark = [pytest.mark.qemu, every_qemu, every_hobby]

WANTED = 3  # sleeping tasks compared, at least
MAX_TICKS = 120  # ticks stopped at, at most, to find them (it stops once WANTED were seen)
NPROC, SLEEPING = 8, 1  # fixtures/hobby/kernel.h: procs[NPROC], enum procstate


def sleepers(oracle: HobbyOracle, hobby: Hobby, boundary: int) -> dict[int, list[int]]:
    """Each sleeping task's pid and its kernel chain as gdb reads the guest's memory."""
    found = {}
    word = "unsigned int" if hobby.word == 4 else "unsigned long long"
    for i in range(NPROC):
        if oracle.value(f"{hobby.names.procs}[{i}].state") != SLEEPING:
            continue
        context = f"{hobby.names.procs}[{i}].context"
        chain = [oracle.value(f"{context}->{hobby.pc}")]
        fp = oracle.value(f"{context}->{hobby.fp}")
        while fp >= boundary:
            ret = oracle.value(f"*({word} *){fp + hobby.word}")
            if ret < boundary:
                break
            chain.append(ret)
            fp = oracle.value(f"*({word} *){fp}")
        found[oracle.value(f"{hobby.names.procs}[{i}].pid")] = chain
    return found


async def compare(tmp_path: Path, hobby: Hobby) -> tuple[int, list[str]]:
    """The tasks gdb found asleep over the moments, and where qmpprof differs."""
    port, counted, differences = free_tcp_port(), 0, []
    with running_hobby(tmp_path, hobby, gdb_port=port) as guest:
        spec = RunSpec(
            kernel=guest.kernel_elf,
            user_dir=guest.user_dir,
            os_options=(("describe", hobby.description),),
        )
        identifier = session.load(spec)
        unwinder = session.unwinder(spec, identifier)
        boundary = unwinder.kernel_boundary
        oracle = HobbyOracle(hobby, guest.kernel_elf, guest.user_dir, port, tmp_path)
        transport = await QmpTransport.connect(guest.qmp_socket)
        try:
            oracle.stop()
            for moment in range(MAX_TICKS):
                # Each tick: the sleepers not woken yet.
                oracle.run_to(hobby.function("wakeup_sleepers"))
                views = await offcpu.every_task(transport, identifier, unwinder, boundary)
                theirs = sleepers(oracle, hobby, boundary)
                ours = {}
                for view in views:
                    assert view.process is not None and view.stack is not None
                    assert view.state == "S"
                    ours[view.process.pid] = [f.pc for f in view.stack.frames if f.kernel]
                counted += len(theirs)
                if ours != theirs:
                    differences.append(f"tick {moment}: gdb {theirs}, qmpprof {ours}")
                if counted >= WANTED:
                    break
        finally:
            oracle.close()
            await transport.close()
    return counted, differences


def test_sleeping_tasks_stacks_are_the_guests_own_record(tmp_path: Path, hobby: Hobby) -> None:
    counted, differences = asyncio.run(compare(tmp_path, hobby))
    print(f"{counted} sleeping tasks compared")
    assert not differences, "\n".join(differences)
    assert counted >= WANTED  # the chatters sleep between their system calls
