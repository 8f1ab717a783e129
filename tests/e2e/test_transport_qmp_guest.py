"""QmpTransport against a real QEMU (SeaBIOS, no kernel: fast to start, no fixtures needed) for
registers, both memory paths, the private memsave file, QMP over TCP, the memsave fallback and
QEMU going away; and both memory paths on the bundled guest."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from guestvm import running_guest
from qemumark import boots_qemu
from qemus import every_qemu

from qmpprof.elf.image import ElfImage
from qmpprof.errors import GuestGoneError, MemoryReadError, TransportError
from qmpprof.transport.qmp import QmpTransport

BIOS = 0xFFFF_0000  # the BIOS ROM below 4 GiB (paging off: virtual = physical)
UNMAPPED = 0xFFFF_FFFF_FFF0_0000


@contextmanager
def bios_qemu(
    tmp_path: Path, *, smp: int = 1, tcp_port: int | None = None, witness: bool = False
) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """qemu-system-x86_64 with no kernel (SeaBIOS idles); killed on the way out. ``witness``:
    a second QMP socket, ``witness.sock`` beside the first."""
    sock = tmp_path / "qmp.sock"
    qmp = f"tcp:127.0.0.1:{tcp_port}" if tcp_port else f"unix:{sock}"
    second = ["-qmp", f"unix:{tmp_path / 'witness.sock'},server=on,wait=off"] if witness else []
    proc = subprocess.Popen(
        ["qemu-system-x86_64", "-accel", "tcg", "-display", "none", "-smp", str(smp),
         "-m", "64", "-net", "none", "-monitor", "none", "-serial", "none",
         "-qmp", f"{qmp},server=on,wait=off", *second],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not _listening(sock, tcp_port):
            assert proc.poll() is None, "QEMU exited"
            assert time.monotonic() < deadline, "QEMU did not open its QMP socket"
            time.sleep(0.02)
        yield sock, proc
    finally:
        proc.kill()
        proc.wait()


def _listening(sock: Path, port: int | None) -> bool:
    """Whether QEMU accepts on its QMP socket: a connection, not the file (QEMU binds the
    socket's file before it listens: a connection between is refused)."""
    if port is None:
        with socket.socket(socket.AF_UNIX) as s:
            return s.connect_ex(str(sock)) == 0
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
@boots_qemu
async def bios(tmp_path: Path) -> AsyncIterator[QmpTransport]:
    with bios_qemu(tmp_path, smp=2) as (sock, _):
        transport = await QmpTransport.connect(sock)
        try:
            yield transport
        finally:
            await transport.close()


@pytest.mark.qemu
@every_qemu
async def test_status_stop_cont_and_registers_of_each_cpu(bios: QmpTransport) -> None:
    assert await bios.is_running()
    assert await bios.cpus() == [0, 1]
    await bios.stop()
    assert not await bios.is_running()  # the STOP event in between is skipped
    regs = await asyncio.gather(bios.registers(0), bios.registers(1))
    assert [r.cpu for r in regs] == [0, 1]
    assert all(r.isa == "i386" and r.special["cpl"] == 0 for r in regs)
    assert regs[0] == await bios.registers(0)  # stopped: nothing moves
    await bios.cont()
    assert await bios.is_running()
    with pytest.raises(TransportError, match="cpu-index"):
        await bios.registers(5)


@pytest.mark.qemu
@every_qemu
async def test_events_are_not_kept(bios: QmpTransport) -> None:
    """Every stop and cont makes QEMU send an event; a long run must not keep them all."""
    for _ in range(50):
        await bios.stop()
        await bios.cont()
    events = bios._client.events
    assert events.empty() and not events.history


CONNECTIONS = (
    1000  # of 400 with no second try, 4 runs in 6 had one event in the way (QEMU 7.2, 11.1)
)


@pytest.mark.qemu
@every_qemu
async def test_connections_made_while_another_client_stops_and_resumes_all_negotiate(
    tmp_path: Path,
) -> None:
    """QEMU emits each STOP and RESUME event from its main thread while a socket's monitor
    greets a new client in its own thread: the event can come before the greeting or in place
    of the reply to qmp_capabilities. Every connection made meanwhile is a session all the
    same, and the guest is left running."""
    with bios_qemu(tmp_path, witness=True) as (sock, _):
        done, toggles = threading.Event(), []

        async def toggle() -> None:
            other = await QmpTransport.connect(tmp_path / "witness.sock")
            try:
                while not done.is_set():
                    await other.stop()
                    await other.cont()
                    toggles.append(1)
            finally:
                await other.close()

        toggler = threading.Thread(target=asyncio.run, args=(toggle(),))
        toggler.start()
        try:
            for _ in range(CONNECTIONS):
                transport = await QmpTransport.connect(sock)
                await transport.close()
            made = len(toggles)
        finally:
            done.set()
            toggler.join()
        assert made >= CONNECTIONS // 4, f"{made} stops and resumes meanwhile"
        transport = await QmpTransport.connect(sock)
        try:
            assert await transport.is_running()
        finally:
            await transport.close()


@pytest.mark.qemu
@every_qemu
async def test_memsave_and_hmp_read_the_same_bytes(bios: QmpTransport) -> None:
    assert bios.memory == "memsave"
    await bios.stop()
    via_memsave = await bios.read(0, BIOS, 8192)
    ragged = await bios.read(0, BIOS + 3, 13)
    bios.memory = "hmp"
    via_hmp = await bios.read(0, BIOS, 8192)
    assert via_memsave == via_hmp and len(via_hmp) == 8192 and any(via_hmp)
    assert await bios.read(0, BIOS + 3, 13) == ragged == via_hmp[3:16]
    await bios.cont()


@pytest.mark.qemu
@every_qemu
@pytest.mark.parametrize("path", ["memsave", "hmp"])
async def test_a_read_of_no_bytes_asks_qemu_nothing(bios: QmpTransport, path: str) -> None:
    # QEMU 7.2's memsave given a negative size died on an assertion (error_setv), QEMU and
    # guest with it: seen under a stack window that ended below its start (memory.py).
    bios.memory = path  # type: ignore[assignment]
    assert await bios.read(0, BIOS, 0) == b"" == await bios.read(0, BIOS, -1664)
    assert await bios.status() in ("running", "paused")  # QEMU answers: it lives


@pytest.mark.qemu
@every_qemu
@pytest.mark.parametrize("path", ["memsave", "hmp"])
async def test_unmapped_memory_is_a_read_error(bios: QmpTransport, path: str) -> None:
    bios.memory = path  # type: ignore[assignment]
    with pytest.raises(MemoryReadError) as info:
        await bios.read(0, UNMAPPED, 4096)
    assert info.value.addr == UNMAPPED


@pytest.mark.qemu
@every_qemu
async def test_memsave_file_is_private_and_removed(tmp_path: Path) -> None:
    with bios_qemu(tmp_path) as (sock, _):
        transport = await QmpTransport.connect(sock)
        await transport.read(0, BIOS, 4096)
        try:
            directory = Path(transport._dump_dir or "")
            dump = directory / "memsave-0.bin"
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700
            assert stat.S_IMODE(dump.stat().st_mode) == 0o600
            await transport.read(0, BIOS, 4096)
            assert [p.name for p in directory.iterdir()] == ["memsave-0.bin"]  # reused
            # Pipelined reads each get a file of their own, and each its own bytes back.
            low, high = await asyncio.gather(
                transport.read(0, BIOS, 4096), transport.read(0, BIOS + 4096, 4096)
            )
            assert low != high
            assert (low, high) == (
                await transport.read(0, BIOS, 4096),
                await transport.read(0, BIOS + 4096, 4096),
            )
            assert sorted(p.name for p in directory.iterdir()) == [
                "memsave-0.bin",
                "memsave-1.bin",
            ]
        finally:
            await transport.close()
        assert not directory.exists()


@pytest.mark.qemu
@every_qemu
async def test_auto_falls_back_to_hmp_when_memsave_cannot_write(tmp_path: Path) -> None:
    with bios_qemu(tmp_path) as (sock, _):
        auto = await QmpTransport.connect(sock)
        first = await auto.read(0, BIOS, 4096)
        os.rmdir(_emptied(auto))  # QEMU can no longer create the file
        assert await auto.read(0, BIOS, 4096) == first
        assert auto.memory == "hmp"
        await auto.close()
        forced = await QmpTransport.connect(sock, memory="memsave")
        await forced.read(0, BIOS, 16)
        os.rmdir(_emptied(forced))
        with pytest.raises(TransportError, match="memsave cannot be used"):
            await forced.read(0, BIOS, 16)
        await forced.close()


def _emptied(transport: QmpTransport) -> str:
    directory = transport._dump_dir or ""
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))  # our fds stay open
    return directory


@pytest.mark.qemu
@every_qemu
async def test_qmp_over_tcp_reads_memory_with_hmp(tmp_path: Path) -> None:
    port = free_port()
    with bios_qemu(tmp_path, tcp_port=port):
        transport = await QmpTransport.connect(tcp=("127.0.0.1", port))
        assert transport.memory == "hmp"
        data = await transport.read(0, BIOS, 4096)
        assert transport._dump_dir is None  # no file was ever involved
        await transport.close()
    assert len(data) == 4096 and any(data)


@pytest.mark.qemu
@every_qemu
async def test_qemu_killed_is_guest_gone(tmp_path: Path) -> None:
    with bios_qemu(tmp_path) as (sock, proc):
        transport = await QmpTransport.connect(sock)
        await transport.stop()
        proc.kill()
        proc.wait()
        with pytest.raises(GuestGoneError):
            for _ in range(100):  # the first call may still be in flight as QEMU dies
                await transport.registers(0)
        with pytest.raises(GuestGoneError):
            await transport.cont()
        await transport.close()


@pytest.mark.qemu
@every_qemu
async def test_both_memory_paths_agree_on_the_bundled_guest(tmp_path: Path) -> None:
    """Kernel addresses (>= 2**63 go out as negative memsave values) and a user stack."""
    with running_guest(tmp_path) as guest:
        transport = await QmpTransport.connect(guest.qmp_socket)
        try:
            await transport.stop()
            regs = await transport.registers(0)
            kernel_text = ElfImage.load(guest.kernel_elf).text_addr
            where = [(kernel_text, 4096), (regs.sp & ~0xFFF, 4096), (regs.pc, 24)]
            assert kernel_text >= 1 << 63
            via = {}
            for path in ("memsave", "hmp"):
                transport.memory = path  # type: ignore[assignment]
                via[path] = [await transport.read(0, addr, size) for addr, size in where]
            await transport.cont()
        finally:
            await transport.close()
    assert via["memsave"] == via["hmp"]
    assert all(len(data) == size for data, (_, size) in zip(via["hmp"], where, strict=True))
    assert any(via["hmp"][0])
