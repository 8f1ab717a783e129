"""The daemon: which VMs to follow, the HTTP server beside them, and an orderly end.

VMs come from the sockets given (followed for good, down while nothing listens) and from a
directory rescanned every RESCAN seconds (one socket per VM, named by its file name, its
settings in ``NAME.toml`` beside it; a VM whose socket file goes away is dropped), or from a
libvirt connection (``--libvirt URI``): every domain that runs there, named by its domain name,
followed as it starts and dropped as it stops, looked up again at each of libvirt's domain
lifecycle events (not polled). Each VM's run is the command line's with its ``--config`` table
applied (``config.py``); every distinct run of the VMs given loads at start, so that a bad file
(or a URI libvirt refuses) ends serve before any VM is touched.
The first SIGINT/SIGTERM stops every sampler after its tick in progress and closes its
transport (the guest runs on, or stays paused), stops the HTTP server and returns 0; a second
one cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import stat
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from qmpprof import transport
from qmpprof.errors import ConnectError, UsageError
from qmpprof.interrupts import interrupts
from qmpprof.naming import Naming
from qmpprof.serve.config import VmSettings
from qmpprof.serve.endpoints import ServeState, listen
from qmpprof.serve.vm import Vm, in_thread
from qmpprof.session import RunSpec, load
from qmpprof.transport import DomainSet

RESCAN = 1.0  # seconds between looks at --qmp-dir
# The most a VM's thread waits for the interpreter while another thread computes (Python's
# default is 5 ms): a reply for a stopped VM is read within it.
SWITCH = 0.0005


@dataclass(frozen=True, slots=True)
class ServeConfig:
    spec: RunSpec  # every VM's run, but for its socket and its settings
    sockets: tuple[tuple[str, Path], ...]  # (name, socket) followed for good
    qmp_dir: Path | None
    host: str
    port: int
    window: int  # seconds kept
    naming: Naming
    settings: dict[str, VmSettings] = dataclasses.field(default_factory=dict)  # --config
    libvirt: str | None = None  # --libvirt URI: its running domains are the VMs

    def spec_of(self, name: str) -> RunSpec:
        """The run of the VM ``name``, its --config table applied (its NAME.toml is not)."""
        found = self.settings.get(name)
        return self.spec if found is None else found.apply(self.spec)


class Daemon:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.board = ServeState(config.window, config.naming)
        self.tasks: dict[str, tuple[Vm, asyncio.Future[None]]] = {}  # each in its thread
        self.leaving: set[asyncio.Future[None]] = set()  # dropped VMs finishing their tick
        self.stopping = asyncio.Event()
        self.news = asyncio.Event()  # a look is due: a domain's lifecycle event, or stopping
        self.domains: DomainSet | None = None  # --libvirt's, once open

    def add(self, name: str, where: Path | str, beside: Path | None = None) -> None:
        """Follow the VM ``name`` at ``where``: its QMP socket, or the libvirt URI its domain
        runs at."""
        reach = self.config.spec.reach
        if isinstance(where, str):
            reach = dataclasses.replace(reach, domain=name, connect=where)
        else:
            reach = dataclasses.replace(reach, qmp_socket=where)
        vm = Vm(name, reach, self.config.spec_of(name), self.config.window, beside)
        self.tasks[name] = (vm, in_thread(vm))
        self._publish()

    def drop(self, name: str) -> None:
        vm, task = self.tasks.pop(name)
        vm.stop()
        self.leaving.add(task)
        task.add_done_callback(self.leaving.discard)
        self._publish()

    def _publish(self) -> None:
        self.board.vms = tuple(vm for vm, _ in self.tasks.values())

    def rescan(self) -> None:
        """Follow the sockets that appeared in --qmp-dir, drop those that went away."""
        directory = self.config.qmp_dir
        if directory is None:
            return
        fixed = {name for name, _ in self.config.sockets}
        found = {p.name: p for p in _sockets_in(directory) if p.name not in fixed}
        for name in [n for n in self.tasks if n not in fixed and n not in found]:
            self.drop(name)
        for name, path in sorted(found.items()):
            if name not in self.tasks:
                self.add(name, path, path.with_name(f"{name}.toml"))

    def follow_domains(self) -> None:
        """Follow the domains that run now (paused ones too), drop those that no longer do."""
        if self.domains is None:
            return
        running = self.domains.running()
        for name in sorted(set(self.tasks) - running):
            self.drop(name)
        for name in sorted(running - set(self.tasks)):
            self.add(name, self.config.libvirt or "")

    def _wake(self) -> None:
        self.news.set()

    async def _look(self) -> None:
        """Until a domain's lifecycle event, a signal, or (with --qmp-dir) RESCAN seconds; then
        the VMs brought up to date."""
        timeout = RESCAN if self.config.qmp_dir is not None else None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.news.wait(), timeout)
        self.news.clear()  # before the look: an event during it makes another
        if self.stopping.is_set():
            return
        self.rescan()
        if self.domains is not None:
            with contextlib.suppress(ConnectError):  # libvirtd went away: its VMs show down
                self.follow_domains()

    def _watch(self) -> None:
        """--libvirt's connection, its events waking ``_look`` (ConnectError: a URI libvirt
        refuses, before any guest is touched)."""
        uri = self.config.libvirt
        if uri is None:
            return
        loop = asyncio.get_running_loop()

        def changed() -> None:  # in libvirt's event thread
            with contextlib.suppress(RuntimeError):  # serve's loop has closed
                loop.call_soon_threadsafe(self._wake)

        self.domains = transport.watch_domains(uri, changed)

    async def run(self, announce: Callable[[str], None]) -> int:
        self._watch()
        try:
            for spec in self._given():
                load(spec)  # a bad file fails now, not once per VM (the loads are kept: shared)
            return await self._serve(announce)
        finally:
            if self.domains is not None:
                self.domains.close()

    async def _serve(self, announce: Callable[[str], None]) -> int:
        try:
            server = listen(self.config.host, self.config.port, self.board)
        except OSError as err:
            where = f"{self.config.host}:{self.config.port}"
            raise UsageError(f"cannot listen on {where}: {err.strerror or err}") from None
        thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
        thread.start()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH)
        try:
            with interrupts(lambda signum: self._stop()):
                try:
                    for name, socket in self.config.sockets:
                        self.add(name, socket)
                    self.rescan()
                    self.follow_domains()
                    host, port = server.server_address[:2]
                    names = ", ".join(vm.name for vm in self.board.vms) or "none yet"
                    announce(f"qmpprof: serving http://{host!s}:{port}/ (VMs: {names})")
                    while not self.stopping.is_set():
                        await self._look()
                finally:
                    self.board.closing.set()
                    for vm, _ in self.tasks.values():
                        vm.stop()
                    await asyncio.gather(*(task for _, task in self.tasks.values()), *self.leaving)
        finally:
            sys.setswitchinterval(switch)
            await asyncio.to_thread(server.shutdown)
            server.server_close()
        return 0

    def _stop(self) -> None:
        self.stopping.set()
        self.news.set()

    def _given(self) -> list[RunSpec]:
        """The distinct runs known at start: the VMs given, and the defaults for --qmp-dir."""
        config = self.config
        specs = [config.spec_of(name) for name, _ in config.sockets]
        if config.qmp_dir is not None or not specs:
            specs.append(config.spec)
        return list(dict.fromkeys(specs))


def _sockets_in(directory: Path) -> list[Path]:
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    found = []
    for path in entries:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(path.stat().st_mode):
                found.append(path)
    return found


async def serve(config: ServeConfig, err: TextIO) -> int:
    def announce(line: str) -> None:
        err.write(line + "\n")
        err.flush()

    return await Daemon(config).run(announce)
