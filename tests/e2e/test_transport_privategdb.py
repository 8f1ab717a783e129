"""The private gdbstub (connect_fast), end to end against a real QEMU running the bundled guest.

The guest gets a second QMP socket: QEMU serves one client per socket, and the transport holds
the first, so the witness (run state, chardevs, the guest's progress) watches through the other.
Every way a run can end must leave no ``gdb`` chardev, no directory and the run state as found.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import tempfile
from pathlib import Path

import pytest
from guestvm import free_tcp_port
from qemus import every_qemu
from witnessvm import WINDOW, Vm, symbol, vm

from qmpprof import transport as transports
from qmpprof.errors import GuestGoneError
from qmpprof.transport import stubdir
from qmpprof.transport.base import Reach
from qmpprof.transport.gdb import GdbTransport
from qmpprof.transport.kinds import HMP_WINDOW
from qmpprof.transport.privategdb import PrivateGdbTransport, connect_fast
from qmpprof.transport.qmp import QmpTransport

pytestmark = [pytest.mark.qemu, every_qemu]


async def fast(machine: Vm) -> PrivateGdbTransport:
    transport, reason = await connect_fast(machine.socket)
    assert reason is None and isinstance(transport, PrivateGdbTransport)
    return transport


async def sample(transport: PrivateGdbTransport) -> None:
    """One tick as the sampler makes it: stop, every vCPU's registers, a stack window, cont."""
    await transport.stop()
    for cpu in await transport.cpus():
        regs = await transport.registers(cpu)
        with contextlib.suppress(Exception):  # the page above a stack may be unmapped
            await transport.read(cpu, regs.sp, WINDOW)
    await transport.cont()


def assert_gone(machine: Vm, directory: str) -> None:
    assert "gdb" not in machine.chardevs()
    assert not os.path.exists(directory)


async def test_a_running_guest_is_profiled_and_left_running(tmp_path: Path) -> None:
    with vm(tmp_path) as machine:
        transport = await fast(machine)
        assert transport.was_running and await transport.is_running()
        assert machine.advances()  # attaching stopped it; it was resumed
        mode = os.stat(transport.directory).st_mode
        assert stat.S_IMODE(mode) == 0o700
        assert os.listdir(transport.directory) == ["gdb.sock"]
        assert "gdb" in machine.chardevs()
        for _ in range(5):
            await sample(transport)
        assert await transport.status() == "running"
        assert "CPU#1" in await transport.hmp("info registers", cpu=1)
        await transport.close()
        assert_gone(machine, transport.directory)
        assert machine.witness.running() and machine.advances()
        await transport.close()  # twice: nothing to do


async def test_a_paused_guest_stays_paused_and_reads_as_over_qmp(tmp_path: Path) -> None:
    with vm(tmp_path, paused=True) as machine:
        transport = await fast(machine)
        assert not transport.was_running and not await transport.is_running()
        machine.witness.close()  # one client per socket: a QmpTransport takes the witness's place
        witness = await QmpTransport.connect(machine.socket.replace("qmp.sock", "witness.sock"))
        try:
            assert await transport.cpus() == await witness.cpus() == [0, 1]
            for cpu in (0, 1):
                ours, theirs = await transport.registers(cpu), await witness.registers(cpu)
                assert (ours.pc, ours.sp, ours.fp, ours.space, ours.special["cpl"]) == (
                    theirs.pc, theirs.sp, theirs.fp, theirs.space, theirs.special["cpl"],
                )  # fmt: skip
                assert ours.gprs == theirs.gprs
                assert (ours.special["fs_base"], ours.special["gs_base"]) == (
                    theirs.special["fs_base"],
                    theirs.special["gs_base"],
                )
                stack = ours.sp & ~0xFFF
                assert await transport.read(cpu, stack, 0x1000) == await witness.read(
                    cpu, stack, 0x1000
                )
            text = symbol(machine.guest.kernel_elf, "kworker_main")
            assert await transport.read(0, text, WINDOW) == await witness.read(0, text, WINDOW)
            assert await witness.status() == "paused"
        finally:
            await transport.close()
            assert await witness.status() == "paused"
            labels = await witness.chardevs()
            await witness.close()
        assert "gdb" not in labels and not os.path.exists(transport.directory)


async def test_close_can_choose_the_run_state(tmp_path: Path) -> None:
    with vm(tmp_path, smp=1) as machine:
        transport = await fast(machine)
        await transport.close(running=False)  # as `record` may want at the end
        assert_gone(machine, transport.directory)
        assert not machine.witness.running() and not machine.advances()
        machine.witness.execute("cont")
        again = await fast(machine)
        await again.stop()
        await again.close(running=True)
        assert machine.witness.running() and machine.advances()


async def test_an_error_inside_the_run_cleans_up(tmp_path: Path) -> None:
    with vm(tmp_path, smp=1) as machine:
        with pytest.raises(ZeroDivisionError):
            async with await fast(machine) as transport:
                await transport.stop()  # the error strikes while the guest is stopped
                _ = 1 / 0
        assert_gone(machine, transport.directory)
        assert machine.witness.running() and machine.advances()


async def test_a_cancelled_run_cleans_up_and_stays_cancelled(tmp_path: Path) -> None:
    with vm(tmp_path) as machine:
        transport = await fast(machine)
        stopped = asyncio.Event()

        async def run() -> None:
            async with transport:
                while True:
                    await transport.stop()
                    stopped.set()
                    await transport.registers(0)
                    await transport.cont()

        task = asyncio.create_task(run())
        await stopped.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert_gone(machine, transport.directory)
        assert machine.witness.running() and machine.advances()


async def test_a_close_cancelled_midway_still_cleans_up(tmp_path: Path) -> None:
    with vm(tmp_path) as machine:
        transport = await fast(machine)
        await transport.stop()
        closing = asyncio.create_task(transport.close())
        await asyncio.sleep(0)  # close has begun: its first step is waiting on the stub
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert_gone(machine, transport.directory)
        assert machine.witness.running() and machine.advances()


async def test_qemu_killed_mid_run(tmp_path: Path) -> None:
    with vm(tmp_path) as machine:
        transport = await fast(machine)
        await transport.stop()
        machine.guest.process.kill()
        machine.guest.process.wait()
        with pytest.raises(GuestGoneError):
            await transport.read(0, (await transport.registers(0)).sp, 64)
        await asyncio.wait_for(transport.close(), 20)  # no hang, no traceback
        assert not os.path.exists(transport.directory)


async def test_qemu_killed_while_running(tmp_path: Path) -> None:
    with vm(tmp_path, smp=1) as machine:
        transport = await fast(machine)
        machine.guest.process.kill()
        machine.guest.process.wait()
        with pytest.raises(GuestGoneError):
            await transport.stop()
        await asyncio.wait_for(transport.close(), 20)
        assert not os.path.exists(transport.directory)


async def test_an_existing_gdbstub_is_left_alone(tmp_path: Path) -> None:
    port = free_tcp_port()
    with vm(tmp_path, smp=1, gdb_port=port) as machine:
        transport, reason = await connect_fast(machine.socket)
        assert isinstance(transport, QmpTransport)
        assert reason is not None and "already has a gdbstub" in reason and "--gdb" in reason
        assert await transport.is_running()
        await transport.close()
        assert "gdb" in machine.chardevs()
        # Still the user's, working (and running: said, as 8.1 and later stubs do not say it).
        theirs = await GdbTransport.connect(f"127.0.0.1:{port}", was_running=True)
        assert await theirs.cpus() == [0]
        await theirs.close()
        assert machine.witness.running()


async def test_a_refused_gdbserver_falls_back_to_qmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(**kwargs: str) -> str:
        made.append(real_mkdtemp(**kwargs))  # the test's own directories too: the last is ours
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(stubdir, "SOCKET_NAME", "missing/gdb.sock")  # QEMU cannot bind it
    with vm(tmp_path, smp=1) as machine:
        transport, reason = await connect_fast(machine.socket)
        assert isinstance(transport, QmpTransport)
        assert reason is not None and reason.startswith("QEMU refused a gdbstub: Failed to bind")
        assert reason.endswith("using QMP") and "\n" not in reason
        assert (await transport.registers(0)).isa == "x86_64"
        await transport.close()
        assert_gone(machine, made[-1])
        assert machine.witness.running()


async def test_qmp_over_tcp_keeps_qmp(tmp_path: Path) -> None:
    """The registry passes the private gdbstub over for QMP over TCP (QEMU may be on another
    host), and says so; HMP's window is QMP's tuning there."""
    with vm(tmp_path, smp=1, qmp_tcp=True) as machine:
        assert machine.qmp_tcp is not None
        opened = await transports.connect(Reach(qmp_tcp=("127.0.0.1", machine.qmp_tcp)))
        transport = opened.transport
        assert isinstance(transport, QmpTransport) and transport.memory == "hmp"
        assert opened.path == (
            "QMP (private-gdb needs a QMP Unix socket, not QMP over TCP: using QMP)"
        )
        assert opened.window == HMP_WINDOW
        await transport.close()
        assert "gdb" not in machine.chardevs()
