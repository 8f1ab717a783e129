"""Fault injection: RUNS runs of the real command line against the real bundled guest, each ended
at a random point of its start or of its sampling by SIGINT, SIGTERM, QEMU killed, or its QMP
connection closed (a relay between qmpprof and QEMU, which the test cuts). Seeded: the seed is
in the test's id, each run's draw in its failure message. Each run is qmpprof's ``main``
forked from a process that imported qmpprof once (tests/support/forkserver.py): the imports
of 200 interpreters were a third to half of the test's time, and are not what it tests.

After each run: the guest is in the run state it had before (some runs start on a paused
guest), QEMU has no gdbstub and the private temporary directory is empty, stderr holds no
traceback and ends with one clear line, and when the run says it collected N samples its
output holds N (when it ended before sampling, there is no output). Every run that got as far
as connecting took the fast path: nothing earlier runs left stood in its way. One QEMU serves
every run but those that kill it.

The random point is a moment the run itself defines, not a time (under load one run's start
takes from 0.5 to 5 s): its handlers in place (its SigCgt in /proc: before it, in the
interpreter's own start, signals have their default actions, interrupts.py), its connection
line (the transport chosen), or its start line and then a drawn number of its pauses of the
guest, as QEMU's events tell them (none on a paused guest, which it samples once unstopped).
A point the run ended before is met at its end.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from qmpevents import QmpEvents
from support.forkserver import ForkServer, Run
from witnessvm import Vm, vm

from qmpprof.output import folded

pytestmark = pytest.mark.qemu

RUNS = 200
SEED = 23
DURATION = "0.2"  # seconds of guest run time a run asks for
KINDS = ("SIGINT", "SIGTERM", "qmp-closed", "qemu-killed")
WEIGHTS = (38, 38, 19, 5)  # a killed QEMU costs a boot: ~10 of them
FAST = "qmpprof: samples travel through a private gdbstub opened over QMP"
# Where a fault lands: the line the run writes there (None: once its handlers are in place).
STAGES = {"started": None, "connected": "qmpprof: samples travel through ",
          "sampling": "qmpprof: sampling "}  # fmt: skip
PAUSES = 12  # of the guest by a sampling run (0.2 s at 10 ms: ~20), drawn from below this
POINT_TIMEOUT = 120.0  # a guard against a hung run, not a speed check
SUMMARY = re.compile(r"^Samples: (\d+) ", re.MULTILINE)
ROOT = Path(__file__).resolve().parents[2]
# What a run imports, imported once by the fork server (tests/support/forkserver.py).
PRELOAD = ("qmpprof.cli.sample", "qmpprof.guest.registry")


class Relay:
    """A Unix socket that passes each connection on to QEMU's QMP socket; ``cut`` closes the
    connections under way (as QEMU would see a monitor client go) and keeps listening."""

    def __init__(self, path: Path, upstream: str) -> None:
        self.upstream = upstream
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(4)
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(self.upstream)
            except OSError:
                client.close()
                upstream.close()
                continue
            with self.lock:
                self.open += [client, upstream]
            done = threading.Barrier(2, action=closing(client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink, done), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, done: threading.Barrier) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
        done.wait()  # the last of the two closes both ends

    def cut(self) -> None:
        with self.lock:
            ends, self.open = self.open, []
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self.cut()


def closing(*ends: socket.socket) -> Callable[[], None]:
    def close() -> None:
        for end in ends:
            end.close()

    return close


@dataclass
class Machine:
    vm: Vm
    relay: Relay
    socket: Path
    pauses: QmpEvents


@contextmanager
def machine(tmp_path: Path, n: int) -> Iterator[Machine]:
    sock_dir = Path(tempfile.mkdtemp(prefix="fi-", dir="/tmp"))
    (tmp_path / f"qemu{n}").mkdir()
    try:
        with vm(tmp_path / f"qemu{n}", smp=2, more_sockets=1) as booted:
            relay = Relay(sock_dir / "relay.sock", booted.socket)
            pauses = QmpEvents(booted.more[0], 30)
            try:
                yield Machine(booted, relay, sock_dir / "relay.sock", pauses)
            finally:
                pauses.close()
                relay.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def handlers_installed(pid: int) -> bool:
    """Whether the process catches SIGTERM (qmpprof's main has run its first line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone: nothing to wait for
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.MULTILINE)[1], 16)  # type: ignore[index]
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def spawn(server: ForkServer, target: Machine, out: Path) -> Run:
    """qmpprof (this tree's), once its handlers are in place."""
    proc = server.start(
        ["--qmp-socket", str(target.socket), "-v", "--duration", DURATION, "-o", str(out)]
    )
    while not handlers_installed(proc.pid):
        time.sleep(0.001)
    return proc


def unfaulted(server: ForkServer, target: Machine, out: Path) -> None:
    """A run without a fault: it takes the fast path and writes what it collected."""
    proc = spawn(server, target, out)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and FAST in err, err
    collected = SUMMARY.search(err)
    assert collected is not None, err
    assert sum(c for _, c in folded.parse(out.read_text())) == int(collected[1])


def reach(proc: Run, target: Machine, line: str | None, pauses: int) -> str:
    """Wait until the run writes a line starting with ``line`` (None: it has begun), then
    until QEMU has told of ``pauses`` whole pauses of the guest (a STOP, then a RESUME) since
    that line was read; or until it ends. What it wrote meanwhile."""
    assert proc.stderr is not None
    err = proc.stderr.fileno()
    deadline = time.monotonic() + POINT_TIMEOUT
    seen = ""
    since = time.time()
    while line is not None and not any(text.startswith(line) for text in seen.splitlines()):
        ready, _, _ = select.select([err], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {line!r} line in {POINT_TIMEOUT} s:\n{seen}"
        chunk = os.read(err, 4096).decode()
        if not chunk:
            return seen  # it ended before that point
        seen += chunk
        since = time.time()
    stopped = False
    while pauses:
        wait = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([err, target.pauses], [], [], wait)
        assert ready, f"{pauses} pauses not seen in {POINT_TIMEOUT} s"
        if err in ready:
            chunk = os.read(err, 4096).decode()
            if not chunk:
                return seen  # it ended before that point
            seen += chunk
        if target.pauses in ready:
            for event, stamp in target.pauses.received():
                whole = stopped and event == "RESUME"  # one pause seen whole
                # A stop before the line does not count: the attach's, an earlier run's.
                stopped = event == "STOP" and stamp >= since
                pauses -= whole
                if not pauses:
                    break
    return seen


def inject(kind: str, proc: Run, target: Machine) -> None:
    if kind in ("SIGINT", "SIGTERM"):
        proc.send_signal(signal.Signals[kind])
    elif kind == "qmp-closed":
        target.relay.cut()
    else:
        target.vm.guest.process.kill()
        target.vm.guest.process.wait()


def check(draw: str, kind: str, code: int, err: str, out: Path, private: Path) -> None:
    """What every run must leave, whatever ended it (the guest's side is checked by the caller)."""
    draw = f"{draw}; stderr:\n{err}"
    assert "Traceback" not in err, draw
    assert list(private.iterdir()) == [], draw
    lines = err.splitlines()
    assert lines, draw
    if "qmpprof: samples travel through" in err:
        assert FAST in err, draw  # nothing a run before left stood in the way
    assert "killed outright" not in err, draw  # no run left anything behind for this one
    collected = SUMMARY.search(err)
    if collected is not None:
        assert sum(c for _, c in folded.parse(out.read_text())) == int(collected[1]), draw
    else:
        assert not out.exists(), draw
    if code == 0:
        assert collected is not None, draw
    elif code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        assert kind == signal.Signals(code - 128).name, draw
        assert lines[-1] == f"qmpprof: interrupted by {kind}", draw
        assert collected is None, draw
    else:
        assert kind in ("qmp-closed", "qemu-killed") and code in (3, 4, 5), draw
        assert lines[-1].startswith("qmpprof: error: "), draw
        assert sum(line.startswith("qmpprof: error: ") for line in lines) == 1, draw


@pytest.mark.parametrize("seed", [SEED], ids=lambda seed: f"seed={seed}")
def test_runs_ended_at_random_points_leave_everything_as_found(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    private = Path(tempfile.mkdtemp(prefix="fip-", dir="/tmp"))  # qmpprof's TMPDIR
    # The fork server's interpreter: where the environment turns bytecode writing off
    # (PYTHONDONTWRITEBYTECODE), it would compile qmpprof's modules, and each run the ones
    # it imports later; they share a cache of the test's own instead.
    inherited = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env = {**inherited, "TMPDIR": str(private), "PYTHONPATH": str(ROOT),
           "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}  # fmt: skip
    outcomes: dict[str, int] = {}
    boots = 0
    # The QEMUs in ``stack`` (a killed one's closes it); one server forks every run.
    with ForkServer(env, ROOT, PRELOAD) as server, ExitStack() as stack:
        target: Machine | None = None
        try:
            for run in range(RUNS):
                kind = rng.choices(KINDS, WEIGHTS)[0]
                paused = kind != "qemu-killed" and rng.random() < 0.2
                stage = rng.choice(list(STAGES))
                pauses = rng.randrange(PAUSES) if stage == "sampling" and not paused else 0
                if target is None:
                    boots += 1
                    target = stack.enter_context(machine(tmp_path, boots))
                    if boots == 1:
                        unfaulted(server, target, tmp_path / "unfaulted.folded")
                state = "paused" if paused else "running"
                draw = f"run {run}: {kind} at {stage} + {pauses} pauses, guest {state}"
                witness = target.vm.witness
                if paused:
                    witness.execute("stop")
                out = tmp_path / f"run{run}.folded"
                proc = spawn(server, target, out)
                before = reach(proc, target, STAGES[stage], pauses)
                inject(kind, proc, target)
                _, rest = proc.communicate(timeout=60)
                err = before + rest
                check(draw, kind, proc.returncode, err, out, private)
                outcomes[f"{kind} -> {proc.returncode}"] = (
                    outcomes.get(f"{kind} -> {proc.returncode}", 0) + 1
                )
                if kind == "qemu-killed":
                    stack.close()
                    target = None
                    continue
                chardevs = witness.execute("query-chardev")  # one round trip for both
                assert "gdb" not in [c["label"] for c in chardevs], draw
                # QEMU's chardev for gdb's monitor command: made by the first stub, then reused.
                assert sum(c["filename"] == "gdb" for c in chardevs) <= 1, draw
                status = witness.execute("query-status")["status"]
                assert status == ("paused" if paused else "running"), draw
                if paused:
                    witness.execute("cont")
        finally:
            shutil.rmtree(private, ignore_errors=True)
    print(f"seed {seed}: {RUNS} runs, {boots} QEMUs;", dict(sorted(outcomes.items())))
    # The draw reached every stage: runs ended before sampling, runs stopped while sampling,
    # and runs whose QMP connection closed while sampling over the gdbstub (which goes on: the
    # stub is removed over a new connection at the end).
    assert outcomes.get("SIGINT -> 130", 0) and outcomes.get("SIGTERM -> 0", 0), outcomes
    assert outcomes.get("qmp-closed -> 0", 0), outcomes
