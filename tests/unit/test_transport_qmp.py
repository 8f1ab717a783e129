"""QmpTransport: connection errors against scripted sockets, then a real QEMU (SeaBIOS, no
kernel: fast to start, no fixtures needed) for registers, both memory paths, the private
memsave file, QMP over TCP, the memsave fallback and QEMU going away."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from guestvm import running_guest
from qemumark import boots_qemu
from qemus import every_qemu

from qmpprof.elf.image import ElfImage
from qmpprof.errors import ConnectError, GuestGoneError, MemoryReadError, TransportError
from qmpprof.transport.qmp import MEMSAVES_AT_ONCE, QmpTransport

BIOS = 0xFFFF_0000  # the BIOS ROM below 4 GiB (paging off: virtual = physical)
UNMAPPED = 0xFFFF_FFFF_FFF0_0000


@contextmanager
def bios_qemu(
    tmp_path: Path, *, smp: int = 1, tcp_port: int | None = None
) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """qemu-system-x86_64 with no kernel (SeaBIOS idles); killed on the way out."""
    sock = tmp_path / "qmp.sock"
    qmp = f"tcp:127.0.0.1:{tcp_port}" if tcp_port else f"unix:{sock}"
    proc = subprocess.Popen(
        ["qemu-system-x86_64", "-accel", "tcg", "-display", "none", "-smp", str(smp),
         "-m", "64", "-net", "none", "-monitor", "none", "-serial", "none",
         "-qmp", f"{qmp},server=on,wait=off"],
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
    if port is None:
        return sock.exists()
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


async def test_missing_socket(tmp_path: Path) -> None:
    with pytest.raises(ConnectError, match=r"no QMP socket at .*nope"):
        await QmpTransport.connect(tmp_path / "nope")


async def test_refused(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listening: connect() is refused
        with pytest.raises(ConnectError, match="connection refused"):
            await QmpTransport.connect(path)


async def test_not_a_qmp_server(tmp_path: Path) -> None:
    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()
        writer.close()

    path = tmp_path / "other.sock"
    server = await asyncio.start_unix_server(talk, path)
    async with server:
        with pytest.raises(ConnectError, match=r"other\.sock: .*QMP"):
            await QmpTransport.connect(path, timeout=2)


async def test_a_server_gone_right_after_negotiating_is_a_connect_error(tmp_path: Path) -> None:
    """The monitor's client cut (or QEMU killed) just as qmp_capabilities was answered."""

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The answer to qmp_capabilities comes with the greeting: the connection ends while
        # qemu.qmp still negotiates (its own assertion fails then).
        writer.write(b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\r\n')
        writer.write(b'{"return": {}}\r\n')
        writer.close()

    path = tmp_path / "cut.sock"
    server = await asyncio.start_unix_server(talk, path)
    async with server:
        with pytest.raises(ConnectError, match="closed the connection during the QMP greeting"):
            await QmpTransport.connect(path, timeout=2)


async def test_silent_server_times_out(tmp_path: Path) -> None:
    writers: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)  # and never say anything

    path = tmp_path / "silent.sock"
    server = await asyncio.start_unix_server(accept, path)
    async with server:
        with pytest.raises(ConnectError, match=r"no QMP greeting within 0\.3 s"):
            await QmpTransport.connect(path, timeout=0.3)
        for writer in writers:
            writer.close()
            await writer.wait_closed()


async def _json_messages(reader: asyncio.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """What a QMP client sends: JSON objects back to back, no separator needed."""
    decoder, pending = json.JSONDecoder(), ""
    while chunk := await reader.read(4096):
        pending += chunk.decode()
        while pending.strip():
            try:
                message, end = decoder.raw_decode(pending.lstrip())
            except json.JSONDecodeError:
                break
            pending = pending.lstrip()[end:]
            yield message


async def test_each_vcpus_registers_are_asked_of_that_vcpu(tmp_path: Path) -> None:
    """A scripted QEMU that answers ``info registers`` for the vCPU the command names, from a
    capture of QEMU 7.2's text (its ``CPU#N`` header says which vCPU it is)."""
    data = Path(__file__).parent / "data" / "hmp" / "seabios-protmode-cpu0.txt"
    block = data.read_bytes().decode()
    asked: list[object] = []

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\r\n')
        async for message in _json_messages(reader):
            args = message.get("arguments", {})
            answer: object = {"arch": "x86_64"} if message["execute"] == "query-target" else {}
            if message["execute"] == "human-monitor-command":
                asked.append(args.get("cpu-index"))
                answer = block.replace("CPU#0", f"CPU#{args.get('cpu-index')}")
            reply = {"return": answer, "id": message.get("id")}
            writer.write(json.dumps(reply).encode() + b"\r\n")
        writer.close()

    path = tmp_path / "scripted.sock"
    server = await asyncio.start_unix_server(talk, path)
    async with server:
        transport = await QmpTransport.connect(path, timeout=2)
        try:
            regs = [await transport.registers(cpu) for cpu in (1, 0, 2)]
        finally:
            await transport.close()
    assert asked == [1, 0, 2]
    assert [r.cpu for r in regs] == [1, 0, 2]


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
async def test_unmapped_memory_is_a_read_error(bios: QmpTransport, path: str) -> None:
    bios.memory = path  # type: ignore[assignment]
    with pytest.raises(MemoryReadError) as info:
        await bios.read(0, UNMAPPED, 4096)
    assert info.value.addr == UNMAPPED


def test_memsave_of_many_ranges_keeps_to_a_few_files() -> None:
    """2,000 ranges read at once through memsave, in a process allowed 64 descriptors (a file
    per range would run out at about 50): every range's bytes come back right, and no more
    than MEMSAVES_AT_ONCE files were ever open."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fakeqmp.py")), "2000", "64"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    right, most = map(int, done.stdout.split())
    assert right == 2000
    assert 1 < most <= MEMSAVES_AT_ONCE


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
