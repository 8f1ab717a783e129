"""A Unix socket server in a thread that stands for a QMP socket (greets, holds one client, or
says nothing), for the command-line checks run before the guest is touched."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

GREETING = b'{"QMP": {"version": {}, "capabilities": []}}\r\n'


class Server:
    """A Unix socket server in a thread: greets each client with ``hello`` (None: says
    nothing) and closes, or with ``hold``, accepts one client, keeps it and accepts no other
    (as QEMU does with a QMP client)."""

    def __init__(self, path: Path, hello: bytes | None = GREETING, hold: bool = False) -> None:
        self.path = path
        self.hello, self.hold = hello, hold
        self.accepted = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.listener.settimeout(0.05)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        kept: list[socket.socket] = []
        while not self.done.is_set():
            if self.hold and kept:
                self.done.wait(0.05)
                continue
            try:
                peer, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            if self.hello is not None:
                peer.sendall(self.hello)
            if self.hold or self.hello is None:
                kept.append(peer)
            else:
                peer.close()
        for peer in kept:
            peer.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.listener.close()
