"""A guest libvirt runs, reached by its domain name (``--domain``, ``--connect``): QMP commands
passed through libvirt's QEMU monitor (libvirt-qemu's virDomainQemuMonitorCommand, as ``virsh
qemu-monitor-command`` sends them), and over them what a local QMP socket gets: the private
gdbstub (privategdb.py) when QEMU can open one where qmpprof reaches it, else QMP alone. With
libvirtwatch.py and the guard's process (guard.py), the only modules importing libvirt's Python
binding.

libvirt owns the monitor and hears QEMU's STOP and RESUME events on it, so its domain state
follows every pause and resume; qmpprof leaves the domain in the state it found it in, as on a
socket. What libvirt records: the first passthrough taints the domain ``custom-monitor`` (a line
in the domain's log, /var/log/libvirt/qemu/NAME.log on a system connection; ``virsh dominfo``
does not show it), for the life of that QEMU process.

A qmpprof killed outright inside a pause: its guard (guard.py) resumes the domain through
libvirt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import libvirt
import libvirt_qemu

from qmpprof.errors import ConnectError, GuestGoneError, TransportError
from qmpprof.transport.base import BootFiles, MemoryPath
from qmpprof.transport.guard import PauseGuard
from qmpprof.transport.qmp import QmpTransport, register_formats

# libvirt's errors for a domain that is gone or no longer runs: QEMU went away. A system error
# from a monitor command is its connection to QEMU failing ("Unable to read from monitor:
# Connection reset by peer", seen on libvirt 9.0 when the domain was destroyed mid-command).
_GONE = (libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_ERR_OPERATION_INVALID, libvirt.VIR_ERR_SYSTEM_ERROR)


class PassthroughClient:
    """QMP commands through libvirt's monitor passthrough, as qmp.MonitorClient. Each call blocks
    in libvirt, so it runs in a thread: libvirt takes them one at a time per domain."""

    def __init__(self, connection: libvirt.virConnect, domain: libvirt.virDomain) -> None:
        self._connection = connection
        self._domain = domain
        # No QMP events come through passthrough: a stop that found the guest running counts as
        # the STOP event QEMU would have sent (``QmpTransport.stop`` tells its own stops so).
        self.stops = 0

    async def execute(self, cmd: str, arguments: Mapping[str, object] | None = None) -> object:
        if cmd != "stop":
            return await self._send(cmd, arguments)
        before = await self._send("query-status", None)
        reply = await self._send(cmd, arguments)
        if isinstance(before, dict) and before.get("status") == "running":
            self.stops += 1
        return reply

    async def _send(self, cmd: str, arguments: Mapping[str, object] | None) -> object:
        message: dict[str, object] = {"execute": cmd}
        if arguments:
            message["arguments"] = dict(arguments)
        try:
            text = await asyncio.to_thread(
                libvirt_qemu.qemuMonitorCommand, self._domain, json.dumps(message), 0
            )
        except libvirt.libvirtError as err:
            # A domain destroyed during the command fails it in several ways (no domain, not
            # running, the monitor's end of file): asked after, the domain says it is gone.
            gone = err.get_error_code() in _GONE or not self._connection.isAlive()
            if gone or not await asyncio.to_thread(_active, self._domain):
                raise GuestGoneError(f"libvirt: {err.get_error_message()}") from err
            raise TransportError(f"libvirt refused {cmd}: {err.get_error_message()}") from err
        reply = json.loads(text)
        if not isinstance(reply, dict):
            raise TransportError(f"{cmd}: unexpected reply {text[:80]!r}")
        error = reply.get("error")
        if isinstance(error, dict):
            raise TransportError(f"QEMU refused {cmd}: {error.get('desc', error)}")
        return reply.get("return")

    async def disconnect(self) -> None:
        with contextlib.suppress(libvirt.libvirtError):
            await asyncio.to_thread(self._connection.close)


class DomainTransport(QmpTransport):
    """QmpTransport over libvirt's monitor passthrough to the domain ``name`` at ``uri`` (None:
    the URI virsh would take). Open it with ``await DomainTransport.open(...)``."""

    uri: str | None = None
    name = ""
    host: str | None = None  # the host the domain runs on, when not this one (qemu+ssh://)

    @classmethod
    async def open(
        cls, uri: str | None, name: str, *, memory: MemoryPath = "auto"
    ) -> DomainTransport:
        """ConnectError (one line) when libvirt cannot be reached or the domain does not run."""
        libvirt.registerErrorHandler(_silent, None)  # libvirt prints every error otherwise
        try:
            connection = await asyncio.to_thread(libvirt.open, uri)
        except libvirt.libvirtError as err:
            raise ConnectError(
                f"libvirt {uri or '(default URI)'}: {err.get_error_message()}"
            ) from err
        try:
            domain = connection.lookupByName(name)
            if not domain.isActive():
                raise ConnectError(f"domain {name} is not running")
        except libvirt.libvirtError as err:
            connection.close()
            raise ConnectError(f"domain {name}: {err.get_error_message()}") from err
        except BaseException:
            connection.close()
            raise
        client = PassthroughClient(connection, domain)
        where = f"domain {name}"
        try:
            formats = await register_formats(client, where)
            host = remote_host(await asyncio.to_thread(connection.getURI))
        except BaseException:
            await client.disconnect()
            raise
        # memsave writes a file where QEMU runs: on another host, memory comes by HMP x.
        chosen: Literal["memsave", "hmp"] = "memsave" if host is None else "hmp"
        chosen = chosen if memory == "auto" else memory
        transport = cls(client, chosen, auto=memory == "auto", formats=formats, address=where)
        transport.uri, transport.name, transport.host = uri, name, host
        return transport

    async def reconnect(self, *, timeout: float = 5.0) -> QmpTransport:
        memory: MemoryPath = "auto" if self._auto else self.memory
        async with asyncio.timeout(timeout):
            return await DomainTransport.open(self.uri, self.name, memory=memory)

    def guard_pauses(self) -> None:
        """A guard (guard.py) that resumes the domain through libvirt should this process die
        inside a pause."""
        if self.guard is None:
            self.guard = PauseGuard.for_domain(self.uri, self.name)


def remote_host(uri: str) -> str | None:
    """The host a libvirt URI reaches when it is not this one (``qemu+ssh://HOST/system``),
    None for a local driver (``qemu:///system``, ``test:///default``)."""
    host = urlsplit(uri).hostname
    return None if not host or host in ("localhost", socket.gethostname()) else host


def domain_boot_files(uri: str | None, name: str) -> BootFiles:
    """The ``<kernel>`` and ``<initrd>`` of the running domain ``name``'s XML (libvirt's live
    definition, read-only), each where this host can read it: a domain on another host
    (``qemu+ssh://``) names files there, and a file this user cannot read is said, not taken.
    Nothing when libvirt cannot tell (the transport then says why, once connecting)."""
    libvirt.registerErrorHandler(_silent, None)
    try:
        connection = libvirt.openReadOnly(uri)
    except libvirt.libvirtError:
        return BootFiles()
    try:
        text = connection.lookupByName(name).XMLDesc(0)
        host = remote_host(connection.getURI())
    except libvirt.libvirtError:
        return BootFiles()
    finally:
        connection.close()
    named = {tag: _os_file(text, tag) for tag in ("kernel", "initrd")}
    if host and any(named.values()):
        return BootFiles(notes=(f"domain {name} boots files on {host}: give --kernel",))
    found, notes = {}, []
    for tag, path in named.items():
        if path is None:
            continue
        if os.access(path, os.R_OK):
            found[tag] = path
        else:
            notes.append(f"domain {name} boots {path} (its <{tag}>), which this user cannot read")
    return BootFiles(found.get("kernel"), found.get("initrd"), tuple(notes))


def _os_file(xml: str, tag: str) -> Path | None:
    """The path in the domain XML's ``<os><TAG>``, None when it has none."""
    try:
        element = ElementTree.fromstring(xml).find(f"os/{tag}")
    except ElementTree.ParseError:
        return None
    text = None if element is None else (element.text or "").strip()
    return Path(text) if text else None


def _active(domain: libvirt.virDomain) -> bool:
    """Whether ``domain`` still runs (paused or not); False when libvirt cannot say."""
    try:
        return bool(domain.isActive())
    except libvirt.libvirtError:
        return False


def _silent(context: object, error: object) -> None:
    """libvirt's error callback: its errors come back as exceptions, told once, by qmpprof."""
