"""The daemon: which VMs to follow, the HTTP server beside them, and an orderly end.

VMs come from the sockets given (followed for good, down while nothing listens) and from a
directory rescanned every RESCAN seconds (one socket per VM, named by its file name, its
settings in ``NAME.toml`` beside it; a VM whose socket file goes away is dropped). Each VM's
run is the command line's with its ``--config`` table applied (``config.py``); every distinct
run of the VMs given loads at start, so that a bad file ends serve before any VM is touched.
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

from qmpprof.errors import UsageError
from qmpprof.interrupts import interrupts
from qmpprof.naming import Naming
from qmpprof.serve.config import VmSettings
from qmpprof.serve.endpoints import ServeState, listen
from qmpprof.serve.vm import Vm, in_thread
from qmpprof.session import RunSpec, load

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

    def add(self, name: str, socket: Path, beside: Path | None = None) -> None:
        vm = Vm(name, socket, self.config.spec_of(name), self.config.window, beside)
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

    async def run(self, announce: Callable[[str], None]) -> int:
        for spec in self._given():
            load(spec)  # a bad file fails now, not once per VM (the loads are kept: shared)
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
            with interrupts(lambda signum: self.stopping.set()):
                try:
                    for name, socket in self.config.sockets:
                        self.add(name, socket)
                    self.rescan()
                    host, port = server.server_address[:2]
                    names = ", ".join(vm.name for vm in self.board.vms) or "none yet"
                    announce(f"qmpprof: serving http://{host!s}:{port}/ (VMs: {names})")
                    while not self.stopping.is_set():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.stopping.wait(), RESCAN)
                        self.rescan()
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
