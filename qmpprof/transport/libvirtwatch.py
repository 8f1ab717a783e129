"""The running domains of one libvirt connection, for ``serve --libvirt URI``: listed on demand,
with a callback at every domain lifecycle event (started, stopped, suspended, resumed, ...) and
when the connection closes. Beside libvirtdomain.py, the only module importing libvirt's binding.

Events come from libvirt's default event loop (``virEventRegisterDefaultImpl``), run in a thread
of its own: libvirt delivers events only to connections opened after an event loop is registered,
and the registration is for the whole process. libvirt's asyncio loop (libvirtaio) binds it to
one asyncio loop instead, and libvirt then adds and removes that loop's watches from whichever
thread makes a libvirt call; serve's VMs make theirs from threads and loops of their own
(serve/vm.py), which asyncio does not allow. With the default loop, every later connection of
the process (the domains' own, libvirtdomain.py) is served by that thread too, keepalive included.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import libvirt

from qmpprof.errors import ConnectError

_started = threading.Lock()
_running: list[threading.Thread] = []  # libvirt's event loop thread, once started


def _event_loop() -> None:
    """libvirt's default event loop, running in a daemon thread from the first call on (it cannot
    be unregistered: it lives as long as the process)."""
    with _started:
        if _running:
            return
        libvirt.virEventRegisterDefaultImpl()
        thread = threading.Thread(target=_run_events, name="libvirt events", daemon=True)
        thread.start()
        _running.append(thread)


def _run_events() -> None:
    while True:
        libvirt.virEventRunDefaultImpl()


class DomainWatch:
    """One connection to ``uri`` and its lifecycle events. Open it with ``DomainWatch.open``."""

    def __init__(self, uri: str, connection: libvirt.virConnect) -> None:
        self.uri = uri
        self._connection = connection
        self._callback: int | None = None

    @classmethod
    def open(cls, uri: str, changed: Callable[[], None]) -> DomainWatch:
        """Connected, with ``changed`` called (in libvirt's event thread) at each domain lifecycle
        event and when the connection closes. ConnectError (one line) when libvirt refuses
        ``uri``."""
        libvirt.registerErrorHandler(_silent, None)  # libvirt prints every error otherwise
        _event_loop()
        try:
            connection = libvirt.open(uri)
        except libvirt.libvirtError as err:
            raise ConnectError(f"libvirt {uri}: {err.get_error_message()}") from err
        watch = cls(uri, connection)
        try:
            watch._callback = connection.domainEventRegisterAny(
                None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, lambda *_: changed(), None
            )
            connection.registerCloseCallback(lambda *_: changed(), None)
        except libvirt.libvirtError as err:
            watch.close()
            raise ConnectError(f"libvirt {uri}: {err.get_error_message()}") from err
        return watch

    def running(self) -> frozenset[str]:
        """The names of the domains that run now (paused ones too: their QEMU is there).
        ConnectError when the connection is lost."""
        try:
            found = self._connection.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
            return frozenset(domain.name() for domain in found)
        except libvirt.libvirtError as err:
            raise ConnectError(f"libvirt {self.uri}: {err.get_error_message()}") from err

    def close(self) -> None:
        # A connection already gone leaves nothing of ours in libvirtd.
        with contextlib.suppress(libvirt.libvirtError):
            if self._callback is not None:
                self._connection.domainEventDeregisterAny(self._callback)
            self._connection.unregisterCloseCallback()
        with contextlib.suppress(libvirt.libvirtError):
            self._connection.close()


def _silent(context: object, error: object) -> None:
    """libvirt's error callback: its errors come back as exceptions, told once, by qmpprof."""
