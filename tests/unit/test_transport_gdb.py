"""GdbTransport (and its pipelined channel) against a scripted stub (a real QEMU's gdbstub:
tests/e2e/test_transport_gdb_guest.py). The packet code has its own tests
(test_transport_gdbpackets.py), whose captured packets serve here too."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable

import pytest
from fakes import FakeTransport, x86
from test_arch_x86regs import CAPTURED_G
from test_transport_gdbpackets import RISCV64_FEATURES

from qmpprof.errors import ConnectError, GuestGoneError, MemoryReadError, TransportError
from qmpprof.model import Registers
from qmpprof.transport import gdbchannel
from qmpprof.transport.gdb import GdbTransport
from qmpprof.transport.gdbpackets import encode_packet

# --- protocol against a scripted stub ----------------------------------------------------------

# A reply, none (c), or several packets: a stop reply the stub sends of its own before the reply.
Responder = Callable[[bytes], bytes | list[bytes] | None]


def qemu_like(body: bytes) -> bytes | None:
    """Answers like QEMU 7.2 for one vCPU; memory 0x1000..0x4fff holds the byte addr & 0xff."""
    if body.startswith(b"qSupported"):
        return b"PacketSize=1000;qXfer:features:read+;vContSupported+"
    if body.startswith(b"qXfer:features:read:target.xml:"):
        return b"l<target><architecture>i386:x86-64</architecture></target>"
    if body in (b"qfThreadInfo", b"qsThreadInfo"):
        return b"m01" if body == b"qfThreadInfo" else b"l"
    if body.startswith(b"Hg") or body == b"D":
        return b"OK"
    if body == b"qC":
        return b"QC01"
    if body == b"g":
        return CAPTURED_G
    if body.startswith(b"m"):
        addr, size = (int(x, 16) for x in body[1:].split(b","))
        if size > 0x800:
            return b"E22"
        if addr < 0x1000 or addr + size > 0x5000:
            return b"E14"
        return bytes((a & 0xFF) for a in range(addr, addr + size)).hex().encode()
    if body == b"c":
        return None
    return b""


class FakeStub:
    """A gdbstub on a local port that answers with ``respond`` and records what it was sent."""

    def __init__(
        self,
        respond: Responder = qemu_like,
        greeting: bytes = b"",
        hang_up: int = 0,
        slow: dict[bytes, float] | None = None,
        hold: tuple[int, int] | None = None,
    ):
        self.respond = respond
        self.slow = slow or {}  # packets answered only after this many seconds
        self.greeting = greeting
        self.hang_up = hang_up  # close the connection after this many packets (0: never)
        self.packets: list[bytes] = []
        # (first, last): the answers to packets first..last-1 (counting from 1) wait until
        # packet `last` has come; a client that waits for an answer before it sends on hangs.
        self.hold = hold
        self.server: asyncio.Server | None = None
        self.handlers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> FakeStub:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()
        # Every client has hung up by now, so each handler is at EOF and about to finish.
        await asyncio.wait_for(asyncio.gather(*self.handlers), 5)

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.append(task)
        writer.write(self.greeting)
        # A client that hangs up with our bytes unread resets the connection: that is its end too.
        with contextlib.suppress(ConnectionError):
            await self._answer(reader, writer)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = b""
        held: list[bytes] = []
        while data := await reader.read(65536):
            buf += data
            while buf := buf.lstrip(b"+"):
                if buf[:1] == b"\x03":
                    body, buf, answer = b"\x03", buf[1:], encode_packet(b"T02thread:01;")
                else:
                    end = buf.find(b"#")
                    if not buf.startswith(b"$") or end < 0 or len(buf) < end + 3:
                        break
                    body, buf = buf[1:end], buf[end + 3 :]
                    reply = self.respond(body)
                    replies = [] if reply is None else reply if isinstance(reply, list) else [reply]
                    answer = b"+" + b"".join(map(encode_packet, replies))
                    if body == b"qCorrupt":
                        answer = b"+" + encode_packet(b"OK")[:-2] + b"00"  # a wrong checksum
                self.packets.append(body)
                if self.hang_up and len(self.packets) >= self.hang_up:
                    return
                if body in self.slow:
                    await asyncio.sleep(self.slow[body])
                held.append(answer)
                if not self.hold or not self.hold[0] <= len(self.packets) < self.hold[1]:
                    writer.write(b"".join(held))
                    held.clear()


async def test_attach_to_a_running_guest_resumes_it() -> None:
    async with FakeStub(greeting=encode_packet(b"T02thread:01;")) as stub:
        transport = await GdbTransport.connect(stub.address)
        assert transport.was_running is True
        assert await transport.is_running()
        await transport.query("qC")  # a round trip, so that the stub has seen what came before
        assert stub.packets[-2:] == [b"c", b"qC"]
        assert await transport.cpus() == [0]
        await transport.close()
        assert stub.packets[-1] == b"D"  # a running guest is detached (left running)


async def test_attach_to_a_paused_guest_keeps_it_paused() -> None:
    async with FakeStub() as stub:
        transport = await GdbTransport.connect(stub.address)
        assert transport.was_running is False
        assert not await transport.is_running()
        await transport.close()
        assert b"c" not in stub.packets and b"D" not in stub.packets


async def test_was_running_given_by_the_caller_wins() -> None:
    async with FakeStub() as stub:
        transport = await GdbTransport.connect(stub.address, was_running=True)
        assert await transport.is_running()
        await transport.stop()
        assert stub.packets[-2:] == [b"\x03", b"qC"]  # the qC is answered after the stop
        assert not await transport.is_running()
        await transport.close(running=True)
        assert stub.packets[-1] == b"D"


async def test_reads_are_chunked_to_the_stub_limit() -> None:
    async with FakeStub() as stub, await GdbTransport.connect(stub.address) as transport:
        data = await transport.read(0, 0x1100, 0x1801)
        assert data == bytes(a & 0xFF for a in range(0x1100, 0x2901))
        await transport.registers(0)
        reads = [p for p in stub.packets if p[:1] in (b"m", b"H", b"g")]
        chunks = [b"m1100,800", b"m1900,800", b"m2100,800", b"m2900,1"]
        assert reads == [b"Hg01", *chunks, b"g"]  # vCPU 0 stays selected for the next request


async def test_error_reply_is_a_memory_read_error() -> None:
    async with FakeStub() as stub, await GdbTransport.connect(stub.address) as transport:
        with pytest.raises(MemoryReadError) as caught:
            await transport.read(0, 0x4F00, 0x200)  # the second half is unmapped
        assert (caught.value.addr, caught.value.size) == (0x4F00, 0x200)
        assert await transport.read(0, 0x4F00, 4) == bytes.fromhex("00010203")  # still in sync


async def test_several_reads_go_in_one_request_and_fail_one_by_one() -> None:
    # held: no answer until the last m packet came (one write, or the client would hang).
    async with (
        FakeStub(hold=(5, 9)) as stub,
        await GdbTransport.connect(stub.address, timeout=2) as transport,
    ):
        found = await transport.read_many(0, [(0x1100, 0x900), (0x4F00, 0x200), (0x2000, 8)])
        assert found[0] == bytes(a & 0xFF for a in range(0x1100, 0x1A00))
        assert isinstance(found[1], MemoryReadError) and found[1].addr == 0x4F00
        assert found[2] == bytes(range(8))  # the read after the failed one is still in sync
        chunks = [b"m1100,800", b"m1900,100", b"m4f00,200", b"m2000,8"]
        assert stub.packets[4:] == [b"Hg01", *chunks]
        assert await transport.read_many(0, []) == []


async def test_unknown_vcpu_is_refused() -> None:
    async with FakeStub() as stub, await GdbTransport.connect(stub.address) as transport:
        with pytest.raises(TransportError, match="no vCPU 5"):
            await transport.registers(5)


async def test_stub_hanging_up_is_guest_gone() -> None:
    async with FakeStub(hang_up=5) as stub, await GdbTransport.connect(stub.address) as transport:
        with pytest.raises(GuestGoneError):
            await transport.registers(0)


async def test_bad_checksum_is_a_transport_error() -> None:
    async with FakeStub() as stub, await GdbTransport.connect(stub.address) as transport:
        with pytest.raises(TransportError, match="checksum"):
            await transport.query("qCorrupt")
        with pytest.raises(TransportError, match="checksum"):  # the stream is not trusted
            await transport.query("qC")


def two_vcpus(body: bytes, selected: list[int]) -> bytes | None:
    """QEMU with two vCPUs whose RIP is 0x1000 * thread id; thread 2 refuses `g`."""
    if body == b"qfThreadInfo":
        return b"m01,02"
    if body.startswith(b"Hg"):
        selected[0] = int(body[2:], 16)
        return b"OK"
    if body == b"g":
        if selected[0] == 2 and len(selected) > 1:
            return b"E01"
        regs = struct.pack("<17Q7I9Q", *([0] * 16), 0x1000 * selected[0], *([0] * 16))
        return (regs + bytes(372)).hex().encode()
    return qemu_like(body)


async def test_concurrent_register_reads_are_pipelined() -> None:
    selected = [1]
    # Packets 4-7 are Hg01 g Hg02 g: no answer before all four came, so a client that waited
    # for the first answer before sending the second request would time out.
    async with (
        FakeStub(lambda body: two_vcpus(body, selected), hold=(5, 8)) as stub,
        await GdbTransport.connect(stub.address, timeout=2) as transport,
    ):
        assert await transport.cpus() == [0, 1]
        results = await asyncio.gather(
            transport.registers(0),
            transport.registers(1),
            transport.registers(7),
            return_exceptions=True,
        )
        assert [r.pc for r in results[:2] if not isinstance(r, BaseException)] == [0x1000, 0x2000]
        assert isinstance(results[2], TransportError) and "no vCPU 7" in str(results[2])
        assert stub.packets[4:] == [b"Hg01", b"g", b"Hg02", b"g"]  # nothing for vCPU 7
        selected.append(1)  # from now on thread 2 refuses its registers
        results = await asyncio.gather(
            transport.registers(0), transport.registers(1), return_exceptions=True
        )
        assert not isinstance(results[0], BaseException) and results[0].pc == 0x1000
        assert isinstance(results[1], TransportError)


async def test_hg_is_sent_only_when_the_selection_changes() -> None:
    selected = [1]

    def respond(body: bytes) -> bytes | list[bytes] | None:
        if body == b"qStopNow":  # as QMP stop does: a stop reply, the selection back to 1
            selected[0] = 1
            return [b"T02thread:01;", b"OK"]
        if body == b"c":  # the next stop (FakeStub answers \x03 itself) resets it as well
            selected[0] = 1
        return two_vcpus(body, selected)

    async with FakeStub(respond) as stub, await GdbTransport.connect(stub.address) as transport:
        rips = [(await transport.registers(cpu)).pc for cpu in (1, 1, 0, 0, 1)]
        assert rips == [0x2000, 0x2000, 0x1000, 0x1000, 0x2000]
        assert stub.packets[4:] == [b"Hg02", b"g", b"g", b"Hg01", b"g", b"g", b"Hg02", b"g"]
        assert await transport.query("qStopNow") == "OK"
        # vCPU 1 looked selected, but the stop reset it: the reply is checked and asked again.
        assert (await transport.registers(1)).pc == 0x2000
        assert stub.packets[-3:] == [b"g", b"Hg02", b"g"]
        del stub.packets[:]
        await transport.cont()
        await transport.stop()  # the stop reply names thread 1: vCPU 0 needs no Hg after it
        assert (await transport.registers(0)).pc == 0x1000
        assert stub.packets == [b"c", b"\x03", b"qC", b"g"]


async def test_a_late_reply_is_not_taken_for_the_next_one() -> None:
    """A reply later than the deadline cannot be told from a packet the stub lost: the
    channel is done, and no later request gets another's reply."""

    def respond(body: bytes) -> bytes | None:
        return {b"qSlow": b"late", b"qC": b"QC01"}.get(body) or qemu_like(body)

    async with (
        FakeStub(respond, slow={b"qSlow": 0.3}) as stub,
        await GdbTransport.connect(stub.address, timeout=0.1) as transport,
    ):
        stopped = "the gdbstub stopped answering \\(nothing for b'qSlow' within 0.1 s"
        with pytest.raises(TransportError, match=stopped):
            await transport.query("qSlow")
        await asyncio.sleep(0.3)  # the late reply arrives meanwhile
        with pytest.raises(TransportError, match=stopped):
            await transport.query("qC")


async def test_a_lost_packet_ends_the_channel() -> None:
    """QEMU's stub eats the first byte of a packet that reaches a running guest and never
    answers it: the request raises at its deadline, and so does every later one, at once."""

    def respond(body: bytes) -> bytes | None:
        return None if body == b"qLost" else qemu_like(body)

    async with (
        FakeStub(respond) as stub,
        await GdbTransport.connect(stub.address, timeout=0.5) as transport,
    ):
        with pytest.raises(TransportError, match=r"nothing for b'qLost' within 0\.5 s"):
            await transport.query("qLost")
        with pytest.raises(TransportError, match=r"nothing for b'qLost' within 0\.5 s"):
            await transport.registers(0)  # answered, but the channel cannot match replies


async def test_stop_and_registers_is_one_round_trip() -> None:
    # Packets: qSupported, qfThreadInfo, qsThreadInfo, c (resume after attach), then \x03 qC
    # Hg01 g: the stop reply and the first answers wait until the g came.
    async with (
        FakeStub(greeting=encode_packet(b"T02thread:01;"), hold=(5, 8)) as stub,
        await GdbTransport.connect(stub.address, timeout=2) as transport,
    ):
        assert await transport.is_running()
        (regs,) = await transport.stop_and_registers([0])
        assert regs.pc == 0x12839  # the captured packet's
        assert not await transport.is_running()
        assert stub.packets[4:] == [b"c", b"\x03", b"qC", b"Hg01", b"g"]
        (again,) = await transport.stop_and_registers([0])  # paused: no second \x03
        assert again.pc == regs.pc and stub.packets[9:] == [b"g"]  # and no second Hg01


async def test_a_qmp_server_is_not_a_gdbstub() -> None:
    greeting = b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\r\n'
    async with FakeStub(greeting=greeting) as stub:
        with pytest.raises(ConnectError, match="not a gdbstub"):
            await GdbTransport.connect(stub.address)


@pytest.mark.parametrize("reset", [False, True])
async def test_a_peer_hanging_up_while_attaching_is_a_connect_error(reset: bool) -> None:
    """QEMU killed while qmpprof attaches to its stub: the peer closes (EOF) or resets."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if reset:  # unread bytes in the buffer at close: the kernel sends RST
            await reader.read(1)
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        with pytest.raises(ConnectError, match="closed the connection while attaching"):
            await GdbTransport.connect(f"127.0.0.1:{port}")


async def test_nothing_listening_is_a_connect_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        await GdbTransport.connect(f"127.0.0.1:{port}")
    with pytest.raises(ConnectError, match=r"no-such\.sock"):
        await GdbTransport.connect("/nonexistent/no-such.sock")


@pytest.mark.parametrize("runs", [True, False])
async def test_a_lost_packet_is_told_at_once_when_the_guest_runs(
    runs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply missing after LOOK_AFTER has the run state asked (QMP, in a real run): a guest
    running means the packet was lost, and the request raises then; a stopped one may only
    have a slow stub, which gets the rest of the deadline."""
    monkeypatch.setattr(gdbchannel, "LOOK_AFTER", 0.1)
    asked: list[bool] = []

    async def guest_runs() -> bool:
        asked.append(runs)
        return runs

    def respond(body: bytes) -> bytes | None:
        return None if body == b"qLost" else qemu_like(body)

    async with (
        FakeStub(respond) as stub,
        await GdbTransport.connect(stub.address, timeout=0.6) as transport,
    ):
        transport.look_with(guest_runs)
        said = r"0\.1 s, and the guest runs" if runs else r"0\.6 s;"
        with pytest.raises(TransportError, match=rf"nothing for b'qLost' within {said}"):
            await transport.query("qLost")
        assert asked == [runs]  # asked once, after LOOK_AFTER
        with pytest.raises(TransportError, match="nothing for b'qLost'"):
            await transport.registers(0)  # the channel is done either way


async def test_registers_a_target_lacks_in_g_come_with_it_in_one_round_trip() -> None:
    # riscv64: g has x0..x31 and pc; priv (the mode) is the one register of a feature that
    # gives it no number, read with p at its place in the description, beside every g.
    names = ("cpu.xml", "fpu.xml", "virtual.xml", "csr.xml")
    annexes = dict(zip(names, RISCV64_FEATURES, strict=True))
    target = "".join(f'<xi:include href="{name}"/>' for name in annexes)

    def riscv64(body: bytes) -> bytes | list[bytes] | None:
        if body.startswith(b"qXfer:features:read:"):
            annex = body.split(b":")[3].decode()
            text = annexes.get(annex, f"<target><architecture>riscv:rv64</architecture>{target}")
            return b"l" + text.encode()
        if body == b"g":
            return struct.pack("<33Q", *range(32), 0x8000_0408).hex().encode()
        if body.startswith(b"p"):
            value = {65: 3, 833: 0x80, 898: 0x1_2345}.get(int(body[1:], 16))
            return b"E01" if value is None else value.to_bytes(8, "little").hex().encode()
        return qemu_like(body)

    async with (
        FakeStub(riscv64) as stub,
        await GdbTransport.connect(stub.address, timeout=2) as transport,
    ):
        connected = len(stub.packets)
        regs = await transport.registers(0)
        assert stub.packets[connected:] == [b"Hg01", b"g", b"p41", b"p341", b"p382"]
        assert regs.pc == 0x8000_0408 and not regs.user and regs.special["paging"] == 0
        assert regs.special["user_pc"] == 0x1_2345  # mstatus.MPP 0: entered from user code


async def test_a_vcpu_whose_registers_are_refused_is_told_apart_from_the_others() -> None:
    """``each_registers`` (every transport's ``stop_and_registers``): a vCPU's refused read
    is that vCPU's error, the others' registers stand; any other error ends the call."""

    class OneRefused(FakeTransport):
        async def registers(self, cpu: int) -> Registers:
            if cpu == 1:
                raise TransportError("E14")
            if cpu == 2:
                raise GuestGoneError("QEMU went away")
            return await super().registers(cpu)

    transport = OneRefused({0: x86(0, 0x1000)}, {})
    first, second = await transport.stop_and_registers([0, 1])
    assert isinstance(first, Registers) and first.pc == 0x1000
    assert isinstance(second, TransportError)
    with pytest.raises(GuestGoneError):
        await transport.stop_and_registers([0, 2])
