"""GdbTransport: packet framing and the register parser (captured packets, a scripted stub),
then end to end against a real QEMU's gdbstub, with QMP as the independent witness."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from guestvm import BUILD_ROOT, Guest, build_fixtures, free_tcp_port, gdb_backtrace, running_guest

from qmpprof.bench.rawqmp import RawQmp
from qmpprof.errors import ConnectError, GuestGoneError, MemoryReadError, TransportError
from qmpprof.transport.gdb import (
    REGISTER_NAMES,
    GdbTransport,
    checksum,
    decode_body,
    decode_registers,
    encode_packet,
    parse_registers,
    parse_thread_ids,
)

# Captured from QEMU 7.2 (SeaBIOS idle in 32-bit protected mode): the `g` reply and the
# `info registers` text of the same stop.
CAPTURED_G = (
    "0000000000000000000800000000000080f415fc000000004602010000000000"
    "e8300003000000000008000000000000102fcc9c00000000bc1f0a"
    + "0"
    * 138
    + "3928010000000000460200000800000010000000100000001000000010000000"
    "1000000000d0f3030000000000d0f30300000000000000000000000011"
    + "0" * 254
    + "7f03"  # the x87 control word (FCW=037f)
    + "0" * 572
    + "801f0000"  # MXCSR=00001f80, the last register
).encode()
CAPTURED_INFO_REGISTERS = """\
EAX=00000000 EBX=00000800 ECX=fc15f480 EDX=00010246
ESI=030030e8 EDI=00000800 EBP=9ccc2f10 ESP=000a1fbc
EIP=00012839 EFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=1
CS =0008 03f3d000 ffffffff 00cf9f00 DPL=0 CS32 [CRA]
FS =0010 03f3d000 ffffffff 00cf9300 DPL=0 DS   [-WA]
CR0=00000011 CR2=00000000 CR3=00000000 CR4=00000000
EFER=0000000000000000
"""


def monitor_fields(text: str) -> dict[str, int]:
    """NAME=hex fields of `info registers`, first occurrence wins (the witness's own parser)."""
    fields: dict[str, int] = {}
    for name, value in re.findall(r"\b([A-Z][A-Z0-9]*) ?=([0-9a-f]+)\b", text):
        fields.setdefault(name, int(value, 16))
    return fields


# --- framing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "framed",
    [
        b"$PacketSize=1000;qXfer:features:read+;vContSupported+;multiprocess+#92",
        b"$OK#9a",
        b"$T05thread:p01.01;#06",
        b"$mp01.01#cd",
        b"$vCont;c;C;s;S#62",
    ],
)
def test_checksum_matches_captured_packets(framed: bytes) -> None:
    body, _, cs = framed[1:].partition(b"#")
    assert checksum(body) == int(cs, 16)
    assert encode_packet(body) == framed


def test_escaping_round_trips_reserved_bytes() -> None:
    body = b"a$b#c}d*e"
    framed = encode_packet(body)
    # Each reserved byte becomes `}` followed by the byte XOR 0x20.
    assert framed[1:-3] == b"a}\x04b}\x03c}]d}\x0ae"
    assert int(framed[-2:], 16) == checksum(framed[1:-3])
    assert decode_body(framed[1:-3]) == body


@pytest.mark.parametrize(
    ("encoded", "decoded"),
    [
        (b"0* ", b"0000"),  # the spec's example: ' ' is 32, so three more copies
        (b'ab*"c', b"abbbbbbc"),  # '"' is 34: five more
        (b"plain", b"plain"),
    ],
)
def test_run_length_decoding(encoded: bytes, decoded: bytes) -> None:
    assert decode_body(encoded) == decoded


@pytest.mark.parametrize(
    ("reply", "tids"),
    [
        (b"m01", {1: b"01"}),
        (b"m1,2,a", {1: b"1", 2: b"2", 10: b"a"}),
        (b"mp01.01,p01.02", {1: b"p01.01", 2: b"p01.02"}),  # after a multiprocess+ gdb
        (b"l", {}),
        (b"", {}),
    ],
)
def test_thread_lists(reply: bytes, tids: dict[int, bytes]) -> None:
    assert parse_thread_ids(reply) == tids


def test_malformed_thread_list_is_a_transport_error() -> None:
    with pytest.raises(TransportError):
        parse_thread_ids(b"mzz")


# --- registers ---------------------------------------------------------------------------------


def test_captured_registers_agree_with_info_registers() -> None:
    regs = decode_registers(CAPTURED_G)
    mon = monitor_fields(CAPTURED_INFO_REGISTERS)
    for name in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip"):
        assert regs["r" + name] == mon["E" + name.upper()], name
    assert regs["eflags"] == mon["EFL"]
    assert regs["cs"] == mon["CS"]
    assert (regs["cr0"], regs["cr3"], regs["efer"]) == (mon["CR0"], mon["CR3"], mon["EFER"])
    assert regs["fs_base"] == 0x03F3D000  # the base column of the FS line


def test_captured_registers_fill_the_model() -> None:
    model = parse_registers(0, CAPTURED_G)
    assert (model.rip, model.rsp, model.rbp) == (0x12839, 0xA1FBC, 0x9CCC2F10)
    assert model.gprs[1] == 0x10246  # DWARF 1 is rdx
    assert model.gprs[3] == 0x800  # DWARF 3 is rbx
    assert model.gprs[2] == 0xFC15F480  # rcx
    assert model.cpl == 0
    assert model.long_mode is False
    assert model.fs_base == 0x03F3D000


def test_long_mode_user_registers_by_hand() -> None:
    # gdb order rax rbx rcx rdx ...: value 0x1000+i at gdb position i tells the mapping apart.
    gprs = [0xFFFF_8000_0000_1000 + i for i in range(16)]
    rip = 0x40_1234
    segments = [0x202, 0x33, 0x2B, 0, 0, 0, 0]  # eflags, then CS with RPL 3 (user)
    tail = [0x7000, 0xFFFF_8880_0000_0000, 0, 0x8005_0033, 0, 0x1234_5000, 0x20, 0, 0xD01]
    raw = struct.pack("<17Q7I9Q", *gprs, rip, *segments, *tail) + bytes(372)
    model = parse_registers(1, raw.hex().encode())
    assert model.cpu == 1
    assert model.gprs[0] == gprs[0]  # rax
    assert model.gprs[1] == gprs[3]  # rdx
    assert model.gprs[2] == gprs[2]  # rcx
    assert model.gprs[3] == gprs[1]  # rbx
    assert [model.gprs[n] for n in range(4, 16)] == gprs[4:]
    assert (model.gprs[16], model.rip) == (rip, rip)
    assert (model.cpl, model.cr3, model.long_mode) == (3, 0x1234_5000, True)
    assert (model.fs_base, model.gs_base) == (0x7000, 0xFFFF_8880_0000_0000)


@pytest.mark.parametrize("payload", [b"00" * 100, b"zz" * 608])
def test_malformed_register_packets_are_transport_errors(payload: bytes) -> None:
    with pytest.raises(TransportError):
        parse_registers(0, payload)


# --- protocol against a scripted stub ----------------------------------------------------------

Responder = Callable[[bytes], bytes | None]


def qemu_like(body: bytes) -> bytes | None:
    """Answers like QEMU 7.2 for one vCPU; memory 0x1000..0x4fff holds the byte addr & 0xff."""
    if body.startswith(b"qSupported"):
        return b"PacketSize=1000;qXfer:features:read+;vContSupported+"
    if body in (b"qfThreadInfo", b"qsThreadInfo"):
        return b"m01" if body == b"qfThreadInfo" else b"l"
    if body.startswith(b"Hg") or body == b"D":
        return b"OK"
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

    def __init__(self, respond: Responder = qemu_like, greeting: bytes = b"", hang_up: int = 0):
        self.respond = respond
        self.greeting = greeting
        self.hang_up = hang_up  # close the connection after this many packets (0: never)
        self.packets: list[bytes] = []
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
        while data := await reader.read(65536):
            buf += data
            while buf := buf.lstrip(b"+"):
                if buf[:1] == b"\x03":
                    buf = buf[1:]
                    self.packets.append(b"\x03")
                    writer.write(encode_packet(b"T02thread:01;"))
                    continue
                end = buf.find(b"#")
                if not buf.startswith(b"$") or end < 0 or len(buf) < end + 3:
                    break
                body, buf = buf[1:end], buf[end + 3 :]
                self.packets.append(body)
                if self.hang_up and len(self.packets) >= self.hang_up:
                    return
                reply = self.respond(body)
                writer.write(b"+" + (b"" if reply is None else encode_packet(reply)))


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
        assert stub.packets[-1] == b"\x03"
        assert not await transport.is_running()
        await transport.close(running=True)
        assert stub.packets[-1] == b"D"


async def test_reads_are_chunked_to_the_stub_limit_and_selected_once() -> None:
    async with FakeStub() as stub, await GdbTransport.connect(stub.address) as transport:
        data = await transport.read(0, 0x1100, 0x1801)
        assert data == bytes(a & 0xFF for a in range(0x1100, 0x2901))
        await transport.registers(0)
        reads = [p for p in stub.packets if p[:1] in (b"m", b"H", b"g")]
        assert reads == [b"Hg01", b"m1100,800", b"m1900,800", b"m2100,800", b"m2900,1", b"g"]


async def test_error_reply_is_a_memory_read_error() -> None:
    async with FakeStub() as stub, await GdbTransport.connect(stub.address) as transport:
        with pytest.raises(MemoryReadError) as caught:
            await transport.read(0, 0x4F00, 0x200)  # the second half is unmapped
        assert (caught.value.addr, caught.value.size) == (0x4F00, 0x200)
        assert await transport.read(0, 0x4F00, 4) == bytes.fromhex("00010203")  # still in sync


async def test_unknown_vcpu_is_refused() -> None:
    async with FakeStub() as stub, await GdbTransport.connect(stub.address) as transport:
        with pytest.raises(TransportError, match="no vCPU 5"):
            await transport.registers(5)


async def test_stub_hanging_up_is_guest_gone() -> None:
    async with FakeStub(hang_up=4) as stub, await GdbTransport.connect(stub.address) as transport:
        with pytest.raises(GuestGoneError):
            await transport.registers(0)


async def test_bad_checksum_is_a_transport_error() -> None:
    async with FakeStub() as stub, await GdbTransport.connect(stub.address) as transport:
        transport._reader.feed_data(b"$OK#00")  # a packet whose checksum is wrong
        with pytest.raises(TransportError, match="checksum"):
            await transport.query("qC")


async def test_a_qmp_server_is_not_a_gdbstub() -> None:
    greeting = b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\r\n'
    async with FakeStub(greeting=greeting) as stub:
        with pytest.raises(ConnectError, match="not a gdbstub"):
            await GdbTransport.connect(stub.address)


async def test_nothing_listening_is_a_connect_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        await GdbTransport.connect(f"127.0.0.1:{port}")
    with pytest.raises(ConnectError, match=r"no-such\.sock"):
        await GdbTransport.connect("/nonexistent/no-such.sock")


def test_register_names_cover_the_parsed_prefix() -> None:
    assert len(REGISTER_NAMES) == 33
    assert REGISTER_NAMES[16:18] == ("rip", "eflags")


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
async def test_registers_agree_with_info_registers(tmp_path: Path) -> None:
    with bundled(tmp_path) as (_, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        assert await transport.cpus() == [0, 1]
        await transport.stop()
        assert not qmp.running()
        for cpu in (0, 1):
            regs = await transport.register_dict(cpu)
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
            assert (model.fs_base, model.gs_base) == (int(bases["FS"], 16), int(bases["GS"], 16))
            assert (model.cpu, model.cpl, model.long_mode) == (cpu, mon["CPL"], True)
            assert (model.rip, model.rsp, model.gprs[1]) == (mon["RIP"], mon["RSP"], mon["RDX"])
        await transport.close(running=True)
        assert qmp.running()


@pytest.mark.qemu
async def test_registers_in_32_bit_mode_agree(tmp_path: Path) -> None:
    # SeaBIOS with no disk idles in 32-bit protected mode: QEMU masks the registers to 32 bits.
    with qemu(tmp_path, []) as (gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        await transport.stop()
        regs = await transport.register_dict(0)
        mon = monitor_fields(qmp.hmp("info registers", cpu=0))
        for name in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip"):
            assert regs["r" + name] == mon["E" + name.upper()], name
        assert (regs["eflags"], regs["cs"], regs["cr0"]) == (mon["EFL"], mon["CS"], mon["CR0"])
        assert not (await transport.registers(0)).long_mode
        await transport.close()


@pytest.mark.qemu
async def test_memory_agrees_with_memsave(tmp_path: Path) -> None:
    with bundled(tmp_path, smp=1) as (guest, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        await transport.stop()
        regs = await transport.registers(0)
        text = symbol(guest.kernel_elf, "kworker_main")
        to_page_end = 0x1000 - (regs.rsp & 0xFFF)  # the page above a stack may be unmapped
        windows = [(regs.rsp & ~0xFFF, 0x1000), (text - 100, 0x2345), (regs.rsp, to_page_end)]
        for addr, size in windows:
            assert await transport.read(0, addr, size) == qmp.memsave(addr, size), hex(addr)
        with pytest.raises(MemoryReadError):
            await transport.read(0, 0xFFFF_9000_0000_0000, 64)  # nothing mapped there
        with pytest.raises(TransportError):
            qmp.memsave(0xFFFF_9000_0000_0000, 64)  # the witness agrees
        await transport.close(running=True)


@pytest.mark.qemu
async def test_stop_cont_and_close_leave_the_guest_as_asked(tmp_path: Path) -> None:
    with bundled(tmp_path, smp=1) as (guest, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        assert transport.was_running and await transport.is_running()
        assert qmp.running() and advances(qmp, guest)  # attaching stopped it, connect resumed
        await transport.stop()
        assert not qmp.running() and not advances(qmp, guest)
        await transport.cont()
        assert qmp.running() and advances(qmp, guest)
        await transport.close(running=False)
        assert not qmp.running()  # closed without detaching: still paused

        again = await GdbTransport.connect(gdb)
        assert not again.was_running and not await again.is_running()
        await again.close(running=True)
        assert qmp.running() and advances(qmp, guest)  # detached: QEMU resumed it

        qmp.execute("stop")
        third = await GdbTransport.connect(gdb, was_running=True)
        assert qmp.running()  # the caller's word wins over what the stub saw
        await third.close()
        assert qmp.running() and advances(qmp, guest)  # default: as it was


@pytest.mark.qemu
async def test_a_qmp_stop_behind_its_back_is_noticed(tmp_path: Path) -> None:
    with bundled(tmp_path, smp=1) as (_, gdb, qmp):
        transport = await GdbTransport.connect(gdb)
        qmp.execute("stop")
        await transport.registers(0)  # the stop reply QEMU sent is read as a notification
        assert not await transport.is_running()
        await transport.stop()  # already paused: returns without waiting for a stop reply
        await transport.close(running=True)
        assert qmp.running()


@pytest.mark.qemu
async def test_after_a_gdb_session_in_multiprocess_mode(tmp_path: Path) -> None:
    # gdb announces multiprocess+, and QEMU keeps spelling thread ids pPID.TID afterwards and
    # refuses a bare D: the transport must still select vCPUs and detach.
    with bundled(tmp_path) as (guest, gdb, qmp):
        assert gdb_backtrace(guest, None, cpu=1)  # gdb leaves the guest stopped
        transport = await GdbTransport.connect(gdb)
        assert not transport.was_running and await transport.cpus() == [0, 1]
        mon = monitor_fields(qmp.hmp("info registers", cpu=1))
        assert (await transport.registers(1)).rip == mon["RIP"]
        await transport.close(running=True)
        assert qmp.running()


@pytest.mark.qemu
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
