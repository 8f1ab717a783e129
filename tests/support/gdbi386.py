"""Show gdb a 32-bit x86 target behind qemu-system-x86_64's gdbstub.

qemu-system-x86_64 describes itself to gdb as ``i386:x86-64`` and sends its 64-bit ``g`` layout
(608 bytes) even while the guest runs in 32-bit protected mode; gdb set to ``i386`` then refuses
the target ("Remote 'g' packet reply is too long"), and gdb left at ``i386:x86-64`` unwinds a
32-bit stack with 8-byte words. This proxy sits between gdb and the stub: it answers
``qXfer:features:read:target.xml`` with an i386 description and rewrites every ``g`` reply into
that layout (each register's low half, the x87 state unchanged, SSE left out), so gdb -- the
oracle the unwinders are judged against -- sees what qemu-system-i386 would show it. ``p`` is
answered from a ``g``. Everything else passes through; the proxy owns the ``+`` acknowledgements
on both sides. QEMU may send a stop packet unasked when a client connects, which gdb would take
for the reply to its first request: the proxy first asks ``?`` itself and swallows everything
up to that answer (T05), and later drops any packet no request asked for. docs/i386.md has the
measured layouts.
"""

from __future__ import annotations

import re
import selectors
import socket
import threading
from dataclasses import dataclass, field

from qmpprof.transport.gdbpackets import decode_body, encode_packet

_SEGMENTS = ("cs", "ss", "ds", "es", "fs", "gs")
_FPU_CONTROL = ("fctrl", "fstat", "ftag", "fiseg", "fioff", "foseg", "fooff", "fop")

# (name, bits, gdb type, byte offset in QEMU 7.2's x86_64 `g` reply). The x86_64 reply holds
# rax rbx rcx rdx rsi rdi rbp rsp r8..r15 rip (8 bytes each), eflags and six selectors (4),
# fs_base gs_base k_gs_base cr0 cr2 cr3 cr4 cr8 efer (8), st0..st7 (10), eight x87 control
# words (4), xmm0..15 (16), mxcsr (4): 608 bytes. Little-endian, so a low half is a prefix.
_GPR_SLOT = {"eax": 0, "ebx": 1, "ecx": 2, "edx": 3, "esi": 4, "edi": 5, "ebp": 6, "esp": 7}
I386_LAYOUT: tuple[tuple[str, int, str, int], ...] = (
    *(
        (name, 32, "data_ptr" if name in ("esp", "ebp") else "int32", 8 * _GPR_SLOT[name])
        for name in ("eax", "ecx", "edx", "ebx", "esp", "ebp", "esi", "edi")
    ),
    ("eip", 32, "code_ptr", 128),
    ("eflags", 32, "int32", 136),
    *((name, 32, "int32", 140 + 4 * i) for i, name in enumerate(_SEGMENTS)),
    *((f"st{i}", 80, "i387_ext", 236 + 10 * i) for i in range(8)),
    *((name, 32, "int32", 316 + 4 * i) for i, name in enumerate(_FPU_CONTROL)),
)
X86_64_G_BYTES = 608

TARGET_XML = (
    '<?xml version="1.0"?><!DOCTYPE target SYSTEM "gdb-target.dtd">'
    "<target><architecture>i386</architecture>"
    '<feature name="org.gnu.gdb.i386.core">'
    + "".join(
        f'<reg name="{name}" bitsize="{bits}" type="{kind}"/>'
        for name, bits, kind, _ in I386_LAYOUT
    )
    + "</feature></target>"
).encode()

# Requests answered by a stop packet once the guest stops again: c, s, vCont;c, vCont;s...
_RESUME = re.compile(rb"^(c|s|C[0-9a-f]{2}|S[0-9a-f]{2}|vCont;[cCsS])")
_XFER = re.compile(rb"^qXfer:features:read:target\.xml:([0-9a-f]+),([0-9a-f]+)$")


def i386_registers(reply: bytes) -> bytes:
    """An x86_64 ``g`` reply (hex text) rewritten into the I386_LAYOUT order (hex text)."""
    if reply.startswith(b"E"):
        return reply
    raw = bytes.fromhex(reply.decode("ascii"))
    if len(raw) != X86_64_G_BYTES:
        raise ValueError(f"g reply of {len(raw)} bytes, expected {X86_64_G_BYTES} (x86_64)")
    out = b"".join(raw[offset : offset + bits // 8] for _, bits, _, offset in I386_LAYOUT)
    return out.hex().encode()


def i386_register(reply: bytes, number: int) -> bytes:
    """Register ``number`` (I386_LAYOUT order) of an x86_64 ``g`` reply, as a ``p`` reply."""
    if reply.startswith(b"E") or number >= len(I386_LAYOUT):
        return b"E01"
    start = sum(bits // 4 for _, bits, _, _ in I386_LAYOUT[:number])
    return i386_registers(reply)[start : start + I386_LAYOUT[number][1] // 4]


@dataclass
class _Stream:
    """One side of the connection: its socket and the bytes not yet parsed."""

    sock: socket.socket
    pending: bytes = b""
    # Replies this side owes, in order: "g", a register number for `p`, "run" for a resume
    # (answered by a stop packet later), "plain" for the rest.
    owed: list[str | int] = field(default_factory=list)

    def tokens(self) -> list[bytes]:
        """Whole tokens received so far: b"\\x03", or a packet body; acks are dropped."""
        out: list[bytes] = []
        while self.pending:
            head = self.pending[:1]
            if head in (b"+", b"-"):
                self.pending = self.pending[1:]
            elif head == b"\x03":
                out.append(head)
                self.pending = self.pending[1:]
            elif head == b"$":
                end = self.pending.find(b"#")
                if end < 0 or len(self.pending) < end + 3:
                    break
                out.append(b"$" + self.pending[1:end])
                self.pending = self.pending[end + 3 :]
            else:
                self.pending = self.pending[1:]  # noise between packets
        return out


class I386GdbProxy:
    """Listens on 127.0.0.1:``port`` for one gdb connection and relays it to the stub at
    ``upstream_port``, translating as the module says (``translate=False``: registers pass
    through, for qemu-system-i386; the connection is still settled). A context manager."""

    def __init__(self, upstream_port: int, *, translate: bool = True) -> None:
        self._upstream_port = upstream_port
        self._translate = translate
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._stop = threading.Event()

    def __enter__(self) -> I386GdbProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            with client, socket.create_connection(("127.0.0.1", self._upstream_port)) as stub:
                # Each reply here is an ack and then a small packet: with Nagle's algorithm on,
                # the packet waits for the peer's delayed ACK of the ack (~40 ms a round trip).
                for sock in (client, stub):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                upstream = _Stream(stub)
                self._settle(upstream)
                self._relay(_Stream(client), upstream)

    @staticmethod
    def _settle(stub: _Stream) -> None:
        """Ask ``?`` and drop every packet up to its answer: the stop QEMU reports unasked on
        a new connection must not reach gdb."""
        stub.sock.settimeout(10)
        stub.sock.sendall(encode_packet(b"?"))
        while True:
            data = stub.sock.recv(65536)
            if not data:
                return
            stub.pending += data
            for token in stub.tokens():  # nothing was asked after `?`: none follows T05
                stub.sock.sendall(b"+")
                if token.startswith(b"$T05"):
                    stub.sock.settimeout(None)
                    return

    def _relay(self, gdb: _Stream, stub: _Stream) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(gdb.sock, selectors.EVENT_READ, gdb)
            sel.register(stub.sock, selectors.EVENT_READ, stub)
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    side: _Stream = key.data
                    data = side.sock.recv(65536)
                    if not data:
                        return
                    side.pending += data
                    for token in side.tokens():
                        if side is gdb:
                            self._from_gdb(token, gdb, stub)
                        else:
                            self._from_stub(token, gdb, stub)

    def _from_gdb(self, token: bytes, gdb: _Stream, stub: _Stream) -> None:
        if token == b"\x03":
            stub.sock.sendall(token)
            return
        gdb.sock.sendall(b"+")
        body = decode_body(token[1:])
        xfer = _XFER.match(body) if self._translate else None
        if xfer is not None:
            offset, length = int(xfer.group(1), 16), int(xfer.group(2), 16)
            chunk = TARGET_XML[offset : offset + length]
            more = offset + length < len(TARGET_XML)
            gdb.sock.sendall(encode_packet((b"m" if more else b"l") + chunk))
            return
        if self._translate and (body == b"g" or re.fullmatch(rb"p[0-9a-f]+", body)):
            stub.owed.append("g" if body == b"g" else int(body[1:], 16))
            body = b"g"
        elif _RESUME.match(body):
            stub.owed.append("run")
        else:
            stub.owed.append("plain")
        stub.sock.sendall(encode_packet(body))

    @staticmethod
    def _from_stub(token: bytes, gdb: _Stream, stub: _Stream) -> None:
        stub.sock.sendall(b"+")
        body = decode_body(token[1:])
        if not stub.owed:
            return  # unasked: the stop report of a new connection
        owed = stub.owed.pop(0)
        if owed == "g":
            body = i386_registers(body)
        elif isinstance(owed, int):
            body = i386_register(body, owed)
        gdb.sock.sendall(encode_packet(body))
