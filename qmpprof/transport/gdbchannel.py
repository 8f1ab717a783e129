"""One connection to a gdbstub, pipelined: every request is written at once, and a reader task
hands the replies out in the order the requests went (the stub answers in order).

So the calls a sampler makes at the same moment (stop, the registers of every vCPU, the reads
of fixed addresses) cost one round trip together, not one each. Stop replies are handed to
``on_stopped`` whoever caused them (a ``\\x03``, QMP, the guest), and end the wait of a request
that asked for it (``until_stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qmpprof.errors import GuestGoneError, QmpprofError, TransportError
from qmpprof.transport.gdbpackets import checksum, decode_body, encode_packet, is_stop_reply


async def read_packet(reader: asyncio.StreamReader, started: bool = False) -> bytes:
    """The next packet body (``started``: its ``$`` was read already); acks before it skipped."""
    try:
        if not started:
            prefix = await reader.readuntil(b"$")
            if prefix.strip(b"+") != b"$":
                raise TransportError(f"unexpected bytes from the gdbstub: {prefix[:40]!r}")
        data = await reader.readuntil(b"#")
        cs = await reader.readexactly(2)
    except (asyncio.IncompleteReadError, ConnectionError) as err:
        raise GuestGoneError("QEMU closed the gdbstub connection") from err
    except asyncio.LimitOverrunError as err:
        raise TransportError("oversized packet from the gdbstub") from err
    body = data[:-1]
    if cs.lower() != b"%02x" % checksum(body):
        raise TransportError(f"bad checksum on a gdbstub packet: {body[:40]!r}")
    return decode_body(body)


@dataclass(eq=False)
class _Request:
    want: int  # replies due
    future: asyncio.Future[list[bytes]]
    until_stop: bool  # done at the first stop reply too (its replies are still consumed)
    replies: list[bytes] = field(default_factory=list)


class Channel:
    """Requests and replies over an open, handshaken gdbstub connection.

    ``ack`` goes in front of every write (QEMU 7.2 has no no-ack mode; see ``gdb``).
    ``on_stopped`` (settable later) is called for every stop reply.
    A request that timed out or was cancelled keeps its place, so its late replies are dropped
    rather than handed to the next one. Once the stub hangs up, every request raises
    GuestGoneError.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        ack: bytes,
        timeout: float,
        on_stopped: Callable[[], None] = lambda: None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._ack = ack
        self._timeout = timeout
        self.on_stopped = on_stopped
        self._pending: list[_Request] = []
        self._error: QmpprofError | None = None
        self._task = asyncio.create_task(self._read_loop())

    def send(self, data: bytes) -> None:
        """Write ``data`` (framed packets or ``\\x03``) with the ack in front; no reply awaited."""
        if self._error is not None:
            raise _again(self._error)
        self._writer.write(self._ack + data)

    async def request(
        self, bodies: Sequence[bytes], *, prefix: bytes = b"", until_stop: bool = False
    ) -> list[bytes]:
        """Send ``prefix`` and the packets ``bodies`` in one write; one reply per packet, in
        order. ``until_stop``: return (no replies) as soon as a stop reply comes, if it comes
        before the last reply."""
        self.send(prefix + b"".join(encode_packet(body) for body in bodies))
        if not bodies:
            return []
        loop = asyncio.get_running_loop()
        request = _Request(len(bodies), loop.create_future(), until_stop)
        self._pending.append(request)
        try:
            async with asyncio.timeout(self._timeout):
                return await request.future
        except TimeoutError as err:
            raise TransportError(f"the gdbstub did not answer {bodies[0]!r}") from err

    async def _read_loop(self) -> None:
        try:
            while True:
                self._dispatch(await read_packet(self._reader))
        except QmpprofError as err:
            self._fail(err)
        except Exception as err:  # a bug here must not leave every caller waiting: tell them
            self._fail(TransportError(f"the gdbstub reply reader failed: {err!r}"))

    def _fail(self, err: QmpprofError) -> None:
        """From now on every request raises ``err``; those waiting get it at once."""
        self._error = err
        for request in self._pending:
            if not request.future.done():
                request.future.set_exception(_again(err))
        self._pending.clear()

    def _dispatch(self, reply: bytes) -> None:
        if is_stop_reply(reply):
            if reply[:1] in (b"W", b"X"):
                raise GuestGoneError(f"the guest exited ({reply.decode(errors='replace')})")
            self.on_stopped()
            for request in self._pending:
                if request.until_stop and not request.future.done():
                    request.future.set_result([])
            return
        if not self._pending:
            return  # nobody asked: a stray reply, dropped
        request = self._pending[0]
        request.replies.append(reply)
        if len(request.replies) == request.want:
            self._pending.pop(0)
            if not request.future.done():  # its caller may have given up
                request.future.set_result(request.replies)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._error is None:
            self._fail(GuestGoneError("the gdbstub connection is closed"))
        self._writer.close()
        with contextlib.suppress(ConnectionError):  # the peer may be gone already
            await self._writer.wait_closed()


def _again(err: QmpprofError) -> QmpprofError:
    """A fresh exception like ``err`` for each caller (one object raised twice grows its
    traceback)."""
    if isinstance(err, GuestGoneError):
        return GuestGoneError(str(err))
    return TransportError(str(err))
