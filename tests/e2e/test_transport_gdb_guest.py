"""GdbTransport end to end against a real QEMU's gdbstub, with QMP on a plain socket as the
independent witness: registers, memory, stop/cont, vCPUs stopped behind its back, the target
description, a unix socket and the guest going away."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from guestvm import BUILD_ROOT, Guest, build_fixtures, free_tcp_port, gdb_backtrace, running_guest
from monitortext import monitor_fields
from qemus import every_qemu
from support.bench.rawqmp import RawQmp

from qmpprof.arch.x86regs import REGISTER_NAMES, X86Formats
from qmpprof.errors import ConnectError, GuestGoneError, MemoryReadError, TransportError
from qmpprof.transport.gdb import GdbTransport

# --- end to end against QEMU's gdbstub -----------------------------------------------------------
# The bundled guest (64-bit kernel and user processes); QMP on a plain socket is the independent
# witness of registers, memory and run state.

PROGRESS = "progress_counter"


@contextlib.contextmanager
def bundled(tmp_path: Path, smp: int = 2) -> Iterator[tuple[Guest, str, RawQmp]]:
    """The cfi guest with its workload running, its gdbstub address and a QMP witness."""
    port = free_tcp_port()
    with (
        running_guest(tmp_path, "cfi", smp, gdb_port=port) as guest,
        RawQmp(str(guest.qmp_socket)) as qmp,
    ):
        yield guest, f"127.0.0.1:{port}", qmp


def symbol(elf: Path, name: str) -> int:
    for line in subprocess.run(["nm", "-P", str(elf)], capture_output=True, text=True).stdout.split(
        "\n"
    ):
        fields = line.split()
        if fields and fields[0] == name:
            return int(fields[2], 16)
    raise AssertionError(f"no {name} in {elf}")


def progress(qmp: RawQmp, guest: Guest) -> int:
    value: int = struct.unpack("<Q", qmp.memsave(symbol(guest.kernel_elf, PROGRESS), 8))[0]
    return value


def advances(qmp: RawQmp, guest: Guest) -> bool:
    """Whether the guest gets work done within a while (it runs), read over QMP."""
    first = progress(qmp, guest)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if progress(qmp, guest) != first:
            return True
    return False


@pytest.mark.qemu
@every_qemu
async def test_registers_agree_with_info_registers(tmp_path: Path) -> None:
    with bundled(tmp_path) as (_, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        assert await transport.cpus() == [0, 1]
        await transport.stop()
        assert not qmp.running()
        for cpu in (0, 1):
            regs = X86Formats().gdb_named(await transport.register_packet(cpu))
            model = await transport.registers(cpu)
            text = qmp.hmp("info registers", cpu=cpu)
            mon = monitor_fields(text)
            for name in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip"):
                assert regs["r" + name] == mon["R" + name.upper()], (cpu, name)
            for n in range(8, 16):
                assert regs[f"r{n}"] == mon[f"R{n}"], (cpu, n)
            assert regs["eflags"] == mon["RFL"]
            for name in ("cs", "ss", "ds", "es", "fs", "gs", "cr0", "cr2", "cr3", "cr4", "efer"):
                assert regs[name] == mon[name.upper()], (cpu, name)
            bases = dict(re.findall(r"^(FS|GS) =[0-9a-f]+ ([0-9a-f]+) ", text, re.MULTILINE))
            assert (model.special["fs_base"], model.special["gs_base"]) == (
                int(bases["FS"], 16),
                int(bases["GS"], 16),
            )
            assert (model.cpu, model.special["cpl"], model.isa == "x86_64") == (
                cpu,
                mon["CPL"],
                True,
            )
            assert (model.pc, model.sp, model.gprs[1]) == (mon["RIP"], mon["RSP"], mon["RDX"])
        both = await asyncio.gather(transport.registers(0), transport.registers(1))
        for cpu, regs in enumerate(both):
            assert regs.pc == monitor_fields(qmp.hmp("info registers", cpu=cpu))["RIP"]
        await transport.cont()
        fused = await transport.stop_and_registers([0, 1])
        assert not qmp.running()
        for cpu, regs in enumerate(fused):
            mon = monitor_fields(qmp.hmp("info registers", cpu=cpu))
            assert (regs.pc, regs.sp, regs.space) == (mon["RIP"], mon["RSP"], mon["CR3"])
        await transport.close(running=True)
        assert qmp.running()


@pytest.mark.qemu
@every_qemu
async def test_registers_in_32_bit_mode_agree(tmp_path: Path) -> None:
    # SeaBIOS with no disk idles in 32-bit protected mode: QEMU masks the registers to 32 bits.
    with qemu(tmp_path, []) as (gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        await transport.stop()
        regs = X86Formats().gdb_named(await transport.register_packet(0))
        mon = monitor_fields(qmp.hmp("info registers", cpu=0))
        for name in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip"):
            assert regs["r" + name] == mon["E" + name.upper()], name
        assert (regs["eflags"], regs["cs"], regs["cr0"]) == (mon["EFL"], mon["CS"], mon["CR0"])
        assert (await transport.registers(0)).isa == "i386"
        await transport.close()


@pytest.mark.qemu
@every_qemu
async def test_memory_agrees_with_memsave(tmp_path: Path) -> None:
    with bundled(tmp_path, smp=1) as (guest, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        await transport.stop()
        regs = await transport.registers(0)
        text = symbol(guest.kernel_elf, "kworker_main")
        to_page_end = 0x1000 - (regs.sp & 0xFFF)  # the page above a stack may be unmapped
        windows = [(regs.sp & ~0xFFF, 0x1000), (text - 100, 0x2345), (regs.sp, to_page_end)]
        for addr, size in windows:
            assert await transport.read(0, addr, size) == qmp.memsave(addr, size), hex(addr)
        together = await transport.read_many(0, [*windows, (0xFFFF_9000_0000_0000, 64)])
        assert together[:-1] == [qmp.memsave(addr, size) for addr, size in windows]
        assert isinstance(together[-1], MemoryReadError)
        with pytest.raises(MemoryReadError):
            await transport.read(0, 0xFFFF_9000_0000_0000, 64)  # nothing mapped there
        with pytest.raises(TransportError):
            qmp.memsave(0xFFFF_9000_0000_0000, 64)  # the witness agrees
        await transport.close(running=True)


@pytest.mark.qemu
@every_qemu
async def test_stop_cont_and_close_leave_the_guest_as_asked(tmp_path: Path) -> None:
    with bundled(tmp_path, smp=1) as (guest, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        # Attaching stopped it. A stub that says so (7.2's stop reply) is believed and the guest
        # resumed; one that says nothing (8.1 and later) leaves it taken as paused, and paused.
        assert transport.was_running == transport.state_known
        assert qmp.running() == transport.was_running == await transport.is_running()
        if not transport.was_running:
            await transport.cont()
        assert qmp.running() and advances(qmp, guest)
        await transport.stop()
        assert not qmp.running() and not advances(qmp, guest)
        await transport.cont()
        assert qmp.running() and advances(qmp, guest)
        await transport.close(running=False)
        assert not qmp.running()  # closed without detaching: still paused

        again = await GdbTransport.connect(gdb)
        assert not again.was_running and not again.state_known and not await again.is_running()
        await again.close(running=True)
        assert qmp.running() and advances(qmp, guest)  # detached: QEMU resumed it

        qmp.execute("stop")
        third = await GdbTransport.connect(gdb, was_running=True)
        assert qmp.running() and third.state_known  # the caller's word wins over the stub's
        await third.close()
        assert qmp.running() and advances(qmp, guest)  # default: as it was


@pytest.mark.qemu
@every_qemu
async def test_a_qmp_stop_behind_its_back_is_noticed(tmp_path: Path) -> None:
    with bundled(tmp_path, smp=1) as (_, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        qmp.execute("stop")
        await transport.registers(0)  # the stop reply QEMU sent is read as a notification
        assert not await transport.is_running()
        await transport.stop()  # already paused: returns without waiting for a stop reply
        await transport.cont()
        qmp.execute("stop")  # and at once, before the transport read that stop reply:
        await asyncio.wait_for(transport.stop(), 2)  # no second stop reply comes: no hang
        assert not qmp.running() and not await transport.is_running()
        await transport.close(running=True)
        assert qmp.running()


@pytest.mark.qemu
@every_qemu
async def test_a_stop_behind_its_back_does_not_mix_up_vcpus(tmp_path: Path) -> None:
    # A stop selects vCPU 0 for g and m again: a request for vCPU 1 sent without an Hg, relying
    # on the selection made before that stop, must be noticed (reply order) and asked again.
    with bundled(tmp_path) as (_, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        for _ in range(3):
            await transport.stop()
            await transport.registers(1)  # vCPU 1 is selected now
            await transport.cont()
            qmp.execute("stop")
            regs = await transport.registers(1)
            mon = monitor_fields(qmp.hmp("info registers", cpu=1))
            assert (regs.pc, regs.sp) == (mon["RIP"], mon["RSP"])  # each vCPU its own stack
            assert not await transport.is_running()
            await transport.cont()
        await transport.close(running=True)
        assert qmp.running()


@pytest.mark.qemu
@every_qemu
async def test_after_a_gdb_session_in_multiprocess_mode(tmp_path: Path) -> None:
    # gdb announces multiprocess+, and QEMU keeps spelling thread ids pPID.TID afterwards and
    # refuses a bare D: the transport must still select vCPUs and detach.
    with bundled(tmp_path) as (guest, gdb, qmp):
        assert gdb_backtrace(guest, None, cpu=1)  # gdb leaves the guest stopped
        transport = await GdbTransport.connect(gdb)
        assert not transport.was_running and await transport.cpus() == [0, 1]
        mon = monitor_fields(qmp.hmp("info registers", cpu=1))
        assert (await transport.registers(1)).pc == mon["RIP"]
        await transport.close(running=True)
        assert qmp.running()


@pytest.mark.qemu
@every_qemu
async def test_target_description_matches_the_parsed_layout(tmp_path: Path) -> None:
    with bundled(tmp_path, smp=1) as (_, gdb, _qmp):
        transport = await GdbTransport.connect(gdb)
        top = await transport.target_xml()
        (include,) = re.findall(r'<xi:include href="([^"]+)"', top)
        core = re.sub(r"<!--.*?-->", "", await transport.target_xml(include), flags=re.DOTALL)
        regs = re.findall(r'<reg name="(\w+)" bitsize="(\d+)"', core)
        assert [name for name, _ in regs[: len(REGISTER_NAMES)]] == list(REGISTER_NAMES)
        await transport.stop()
        packet = await transport.query("g")
        assert len(packet) == 2 * sum(int(bits) // 8 for _, bits in regs)  # all, in order
        await transport.close(running=True)


@contextlib.contextmanager
def qemu(tmp_path: Path, args: list[str], *, unix: bool = False) -> Iterator[tuple[str, RawQmp]]:
    """QEMU with ``args``, a gdbstub (TCP, or a Unix socket) and a QMP witness; killed after."""
    sock_dir = Path(tempfile.mkdtemp(prefix="qg-gdb-", dir="/tmp"))  # short socket paths
    gdb = str(sock_dir / "gdb.sock") if unix else f"127.0.0.1:{free_tcp_port()}"
    cmd = ["qemu-system-x86_64", "-accel", "tcg", "-display", "none", "-m", "64", *args]
    cmd += ["-gdb", f"unix:{gdb},server=on,wait=off" if unix else f"tcp:{gdb}"]
    cmd += ["-qmp", f"unix:{sock_dir / 'qmp.sock'},server=on,wait=off"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                witness = RawQmp(str(sock_dir / "qmp.sock"))
                break
            except ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, "QEMU did not start"
                time.sleep(0.02)
        with witness:
            yield gdb, witness
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.mark.qemu
@every_qemu
async def test_unix_socket_and_guest_gone(tmp_path: Path) -> None:
    build_fixtures()
    kernel = BUILD_ROOT / "cfi" / "kernel.elf"
    with qemu(tmp_path, ["-kernel", str(kernel), "-no-reboot"], unix=True) as (gdb, _):
        transport = await GdbTransport.connect(gdb)
        assert await transport.cpus() == [0]
        await transport.stop()
        assert (await transport.registers(0)).cpu == 0
        with pytest.raises(ConnectError, match="not a gdbstub"):
            await GdbTransport.connect(str(Path(gdb).with_name("qmp.sock")), timeout=2)
        with pytest.raises(ConnectError, match="no-such"):
            await GdbTransport.connect(str(Path(gdb).with_name("no-such.sock")))
    # The with-block killed QEMU under the open connection.
    with pytest.raises(GuestGoneError):
        await transport.read(0, 0x1000, 16)
    await transport.close()
