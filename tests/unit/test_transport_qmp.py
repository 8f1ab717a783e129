"""QmpTransport: connection errors and requests against scripted sockets (a real QEMU:
tests/e2e/test_transport_qmp_guest.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from qmpprof.errors import ConnectError
from qmpprof.transport.qmp import MEMSAVES_AT_ONCE, QmpTransport


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


_GREETING = b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\r\n'
_EVENT = b'{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "RESUME"}\r\n'


def _event_in_the_way(first: int) -> tuple[list[str], Any]:
    """A QEMU whose first ``first`` connections get an event in the way of the negotiation
    (before the greeting, then in place of qmp_capabilities' reply, in turn); the others are
    answered. Returns the log of what each connection met, and the server's handler."""
    met: list[str] = []

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind = "answered" if len(met) >= first else ("before", "instead")[len(met) % 2]
        met.append(kind)
        writer.write(_EVENT + _GREETING if kind == "before" else _GREETING)
        async for message in _json_messages(reader):
            if message["execute"] == "qmp_capabilities" and kind == "instead":
                writer.write(_EVENT)
                continue
            answer: object = {"arch": "x86_64"} if message["execute"] == "query-target" else {}
            writer.write(json.dumps({"return": answer, "id": message.get("id")}).encode() + b"\r\n")
        writer.close()

    return met, talk


async def test_an_event_in_the_way_of_the_negotiation_is_tried_again(tmp_path: Path) -> None:
    """QEMU can send an event before its greeting or before the reply to qmp_capabilities
    (qmp.py's ``_negotiated``): another connection, and the run goes on."""
    met, talk = _event_in_the_way(2)
    path = tmp_path / "events.sock"
    server = await asyncio.start_unix_server(talk, path)
    async with server:
        transport = await QmpTransport.connect(path, timeout=2)
        await transport.close()
    assert met == ["before", "instead", "answered"]


async def test_a_server_that_never_negotiates_is_tried_a_few_times(tmp_path: Path) -> None:
    met, talk = _event_in_the_way(100)
    path = tmp_path / "events.sock"
    server = await asyncio.start_unix_server(talk, path)
    async with server:
        with pytest.raises(ConnectError, match=r"events\.sock: not a QMP server"):
            await QmpTransport.connect(path, timeout=2)
    assert met == ["before", "instead", "before"]


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
    data = Path(__file__).parents[1] / "data" / "hmp" / "seabios-protmode-cpu0.txt"
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


def test_memsave_of_many_ranges_keeps_to_a_few_files() -> None:
    """2,000 ranges read at once through memsave, in a process allowed 64 descriptors (a file
    per range would run out at about 50): every range's bytes come back right, and no more
    than MEMSAVES_AT_ONCE files were ever open."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "fakeqmp.py"), "2000", "64"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    right, most = map(int, done.stdout.split())
    assert right == 2000
    assert 1 < most <= MEMSAVES_AT_ONCE
