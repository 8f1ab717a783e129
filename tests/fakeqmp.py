"""A scripted QMP server for QmpTransport's unit tests: the greeting, capabilities,
``query-target`` (x86_64) and ``memsave``, which writes into the file it is given the bytes
``pattern`` makes of the address (so every range read can be checked).

Run as a program (``python fakeqmp.py RANGES NOFILE``), it lowers its own RLIMIT_NOFILE to
NOFILE, reads RANGES ranges of 64 bytes in one ``read_many`` through the server and prints
``<ranges read right> <most memsave files open at once>``: a transport that opened a file per
range would run out of descriptors instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

from qmpprof.transport.qmp import QmpTransport

VERSION = {"qemu": {"major": 11, "minor": 1, "micro": 0}, "package": ""}
GREETING = {"QMP": {"version": VERSION, "capabilities": []}}


def pattern(addr: int, size: int) -> bytes:
    """The bytes the fake guest holds at ``addr``: the address itself, repeated."""
    return (addr.to_bytes(8, "little") * (size // 8 + 1))[:size]


class FakeQmp:
    """Answers one client; ``most_files`` is the most memsave files open in their directory."""

    def __init__(self) -> None:
        self.most_files = 0

    async def talk(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(json.dumps(GREETING).encode() + b"\r\n")
        # qemu.qmp ends its messages with no newline: they are told apart as JSON values.
        decoder, pending = json.JSONDecoder(), ""
        while chunk := await reader.read(1 << 16):
            pending += chunk.decode()
            while pending.strip():
                try:
                    request, end = decoder.raw_decode(pending.lstrip())
                except json.JSONDecodeError:
                    break  # the rest is still on its way
                pending = pending.lstrip()[end:]
                reply = self.answer(str(request["execute"]), request.get("arguments", {}))
                ids = {"id": request["id"]} if "id" in request else {}
                writer.write(json.dumps({"return": reply, **ids}).encode() + b"\r\n")
            await writer.drain()
        writer.close()

    def answer(self, command: str, args: dict[str, object]) -> object:
        if command == "query-target":
            return {"arch": "x86_64"}
        if command == "memsave":
            path = str(args["filename"])
            self.most_files = max(self.most_files, len(os.listdir(os.path.dirname(path))))
            size, val = int(str(args["size"])), int(str(args["val"]))
            Path(path).write_bytes(pattern(val % (1 << 64), size))
        return {}


async def read_ranges(count: int) -> tuple[int, int]:
    fake = FakeQmp()
    with tempfile.TemporaryDirectory() as where:
        sock = os.path.join(where, "qmp.sock")
        server = await asyncio.start_unix_server(fake.talk, sock)
        transport = await QmpTransport.connect(sock, memory="memsave")
        try:
            ranges = [(0x1000 + 64 * i, 64) for i in range(count)]
            found = await transport.read_many(0, ranges)
        finally:
            await transport.close()
            server.close()
    right = sum(data == pattern(a, n) for (a, n), data in zip(ranges, found, strict=True))
    return right, fake.most_files


def main() -> None:
    count, nofile = int(sys.argv[1]), int(sys.argv[2])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    right, most = asyncio.run(read_ranges(count))
    print(right, most)


if __name__ == "__main__":
    main()
