"""One connection to a gdbstub, pipelined: every request is written at once, and a reader task
hands the replies out in the order the requests went (the stub answers in order).

So the calls a sampler makes at the same moment (stop, the registers of every vCPU, the reads
of fixed addresses) cost one round trip together, not one each. Stop replies are handed to
``on_stopped`` whoever caused them (a ``\\x03``, QMP, the guest), and end the wait of a request
that asked for it (``until_stop``).

Replies come in the order the stub acted, so the reader also knows which thread the stub had
selected for ``g`` and ``m`` when it answered each packet: every stop reply resets the selection
to the thread it names, every ``Hg`` answered OK sets it. ``request_on`` uses that to send
packets without an ``Hg`` in front and still know they acted on the thread meant.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from qmpprof.errors import GuestGoneError, QmpprofError, TransportError
from qmpprof.transport.gdbpackets import checksum, decode_body, encode_packet, is_stop_reply

# Seconds after which a request with no reply has the guest's run state looked at (``lost``):
# a stub loses a packet that reaches a guest something else resumed, and such a run must end
# within a second, not at the channel's deadline, with the guest stopped meanwhile.
LOOK_AFTER = 1.0
_STOP_THREAD = re.compile(rb"thread:(?:p[0-9a-fA-F]+\.)?([0-9a-fA-F]+);")


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
    bodies: Sequence[bytes]
    future: asyncio.Future[list[bytes]]
    until_stop: bool  # done at the first stop reply too (its replies are still consumed)
    on_thread: int | None  # the Hg thread its packets must act on, when it sent no Hg itself
    replies: list[bytes] = field(default_factory=list)
    elsewhere: bool = False  # some packet acted on another thread than ``on_thread``


class Channel:
    """Requests and replies over an open, handshaken gdbstub connection.

    ``ack`` goes in front of every write (QEMU 7.2 has no no-ack mode; see ``gdb``).
    ``on_stopped`` (settable later) is called for every stop reply.
    A request that was cancelled keeps its place, so its late replies are dropped rather than
    handed to the next one. One that timed out ends the channel: every request raises its
    TransportError from then on. Once the stub hangs up, every request raises GuestGoneError.
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
        # Settable later: whether the guest runs (asked of QMP), for a request with no reply
        # after LOOK_AFTER: a running guest means its packet was lost (see ``_wait``).
        self.runs: Callable[[], Awaitable[bool]] | None = None
        self._pending: list[_Request] = []
        self._error: QmpprofError | None = None
        self.selected: int | None = None  # the Hg thread as of the last reply read (None: unknown)
        self.stop_thread: int | None = None  # the thread the last stop reply named
        self._task = asyncio.create_task(self._read_loop())

    def send(self, data: bytes) -> None:
        """Write ``data`` (framed packets or ``\\x03``) with the ack in front; no reply awaited."""
        if self._error is not None:
            raise _fresh_copy(self._error)
        self._writer.write(self._ack + data)

    async def request(
        self, bodies: Sequence[bytes], *, prefix: bytes = b"", until_stop: bool = False
    ) -> list[bytes]:
        """Send ``prefix`` and the packets ``bodies`` in one write; one reply per packet, in
        order. ``until_stop``: return (no replies) as soon as a stop reply comes, if it comes
        before the last reply."""
        return await self._wait(self._submit(bodies, prefix, until_stop, None))

    async def request_on(self, thread: int, bodies: Sequence[bytes]) -> list[bytes] | None:
        """Like ``request``, for packets that act on the ``Hg`` thread, sent without an ``Hg``
        because the caller expects ``thread`` to be selected already. None when some packet
        acted on another thread (a stop the caller did not foresee reset the selection): the
        replies are discarded and the caller asks again with an ``Hg``."""
        request = self._submit(bodies, b"", False, thread)
        replies = await self._wait(request)
        return None if request is not None and request.elsewhere else replies

    def _submit(
        self, bodies: Sequence[bytes], prefix: bytes, until_stop: bool, thread: int | None
    ) -> _Request | None:
        self.send(prefix + b"".join(encode_packet(body) for body in bodies))
        if not bodies:
            return None
        loop = asyncio.get_running_loop()
        request = _Request(bodies, loop.create_future(), until_stop, thread)
        self._pending.append(request)
        return request

    async def _wait(self, request: _Request | None) -> list[bytes]:
        if request is None:
            return []
        look = self.runs is not None and not request.until_stop and self._timeout > LOOK_AFTER
        first = LOOK_AFTER if look else self._timeout
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(first):
                return await asyncio.shield(request.future)
        # The stub may have lost the packet: one that reaches a guest something else resumed
        # (QMP cont, another client) only stops it with its first byte (see gdb.py), and is
        # never answered. Every later reply would then go to the request before its own, each
        # tick waiting out a timeout with the guest stopped: the channel is done. A guest that
        # runs while a reply is awaited in a pause says so at once; a stopped one may only
        # have a slow stub (a loaded host), which has the rest of the deadline.
        if look and await self._guest_runs():
            self._fail(self._lost(request, f"{first:g} s, and the guest runs"))
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout - first):
                    return await asyncio.shield(request.future)
            self._fail(self._lost(request, f"{self._timeout:g} s"))
        return await request.future  # raises what _fail set

    async def _guest_runs(self) -> bool:
        assert self.runs is not None
        try:
            return await self.runs()
        except QmpprofError:  # no answer about it: the deadline decides
            return False

    @staticmethod
    def _lost(request: _Request, within: str) -> TransportError:
        return TransportError(
            f"the gdbstub stopped answering (nothing for {request.bodies[0]!r} within {within};"
            " did something else resume or stop the guest?)"
        )

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
                request.future.set_exception(_fresh_copy(err))
        self._pending.clear()

    def _dispatch(self, reply: bytes) -> None:
        if is_stop_reply(reply):
            if reply[:1] in (b"W", b"X"):
                raise GuestGoneError(f"the guest exited ({reply.decode(errors='replace')})")
            named = _STOP_THREAD.search(reply)
            self.selected = self.stop_thread = int(named[1], 16) if named else None
            self.on_stopped()
            for request in self._pending:
                if request.replies:  # its packets straddle the stop: the rest act elsewhere
                    request.elsewhere = True
                if request.until_stop and not request.future.done():
                    request.future.set_result([])
            return
        if not self._pending:
            return  # nobody asked: a stray reply, dropped
        request = self._pending[0]
        body = request.bodies[len(request.replies)]
        if body.startswith(b"Hg"):
            self.selected = _thread_of(body[2:]) if reply == b"OK" else None
        elif request.on_thread is not None and self.selected != request.on_thread:
            request.elsewhere = True
        request.replies.append(reply)
        if len(request.replies) == len(request.bodies):
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


def _thread_of(spelled: bytes) -> int | None:
    """The thread id of an ``Hg`` argument (``02`` or ``p1.02``)."""
    try:
        return int(spelled.rpartition(b".")[2], 16)
    except ValueError:
        return None


def _fresh_copy(err: QmpprofError) -> QmpprofError:
    """A fresh exception like ``err`` for each caller (one object raised twice grows its
    traceback)."""
    if isinstance(err, GuestGoneError):
        return GuestGoneError(str(err))
    return TransportError(str(err))
