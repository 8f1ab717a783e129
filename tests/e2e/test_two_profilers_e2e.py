"""Two qmpprof runs on one VM (transport/vmmark.py): the real command line against the bundled
guest, through both of its QMP sockets, with both transports (auto: the private gdbstub;
--transport qmp), started in either order at seeded random offsets. Each run either completes
(its profile holds every tick it was asked for) or refuses at once with one line naming the
run that holds the VM (its pid and socket); every run ends within its duration + 5 s of when it
began sampling; and a third QMP socket, polled all along, never sees the guest stand stopped
for long (LONGEST_STOP: why not a second, see there). At the end the VM holds no mark and no
gdbstub, and runs."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from qemus import every_qemu
from qmpevents import wait_stops
from witnessvm import Vm, vm

from qmpprof.errors import TransportError
from qmpprof.output import folded
from qmpprof.transport.vmmark import MARK_ID

pytestmark = [pytest.mark.qemu, every_qemu]

PAIRS = 20
DURATION = 0.5  # seconds of guest run time: 50 ticks at the default 10 ms
TICKS = 50
PAUSES = 5  # of the guest by a run, seen on a socket of the test's own before it acts
LONGEST_STOP = 1.0  # seconds the guest may stand stopped at most (issue 30)
PAUSED = re.compile(r"Pause per sample: .* max ([\d.]+) ms")
REFUSED = re.compile(
    r"^qmpprof: error: (?P<mine>\S+): qmpprof pid (?P<pid>\d+) \(through (?P<theirs>\S+)\)"
    r" is profiling this VM: one profiler per VM at a time\n$"
)


class Observer(threading.Thread):
    """Polls the run state over the witness socket; the longest stretch the guest was seen
    stopped (from the first look that found it stopped to the next that found it running)."""

    def __init__(self, machine: Vm) -> None:
        super().__init__(daemon=True)
        self.machine = machine
        self.longest = 0.0
        self.looks = 0
        self.done = threading.Event()

    def run(self) -> None:
        stopped_since: float | None = None
        while not self.done.is_set():
            state = self.machine.witness.execute("query-status")["status"]
            now = time.monotonic()
            self.looks += 1
            if state == "running":
                stopped_since = None
            elif stopped_since is None:
                stopped_since = now
            if stopped_since is not None:
                self.longest = max(self.longest, now - stopped_since)
            self.done.wait(0.01)


@dataclass
class Run:
    socket: str
    transport: str
    out: Path
    duration: float = DURATION
    process: subprocess.Popen[str] | None = None
    sampling_at: float | None = None  # when it said it began sampling
    ended_at: float | None = None
    err: str = ""

    def start(self) -> None:
        command = [sys.executable, "-m", "qmpprof", "--qmp-socket", self.socket,
                   "--transport", self.transport, "--duration", str(self.duration),
                   "-o", str(self.out)]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        """Read its standard error as it comes: the time of its 'sampling' line, and its end."""
        assert self.process is not None and self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                if line.startswith("qmpprof: sampling "):
                    self.sampling_at = time.monotonic()
                self.err += line
        self.process.wait()
        self.ended_at = time.monotonic()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.wait()

    def wait(self) -> int:
        assert self.process is not None
        code = self.process.wait(timeout=60)
        deadline = time.monotonic() + 10
        while self.ended_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return code


def check_pair(first: Run, second: Run, pauses: list[float]) -> bool:
    """Both ended well; True when one refused. ``pauses``: each run's longest pause (s)."""
    refusals = 0
    for run, other in ((first, second), (second, first)):
        code = run.wait()
        assert run.process is not None and other.process is not None
        if code == 3:
            said = REFUSED.fullmatch(run.err)
            assert said is not None, run.err
            assert (said["mine"], said["theirs"]) == (run.socket, other.socket), run.err
            assert int(said["pid"]) == other.process.pid, run.err
            assert not run.out.exists()
            refusals += 1
            continue
        assert code == 0, run.err
        assert "Traceback" not in run.err
        assert sum(c for _, c in folded.parse(run.out.read_text())) == TICKS, run.err
        # Every run ends within its duration + 5 s (issue 30): from its start of sampling to
        # its exit, the transport closed and the interpreter gone.
        paused = PAUSED.search(run.err)
        assert paused is not None, run.err
        pauses.append(float(paused[1]) / 1e3)
        assert run.sampling_at is not None and run.ended_at is not None
        assert run.ended_at - run.sampling_at < run.duration + 5, run.err
    assert refusals <= 1
    return refusals == 1


def test_two_profilers_on_one_vm_never_freeze_it(tmp_path: Path) -> None:
    draw = random.Random(30)
    refused = 0
    pauses: list[float] = []
    with vm(tmp_path, smp=1, more_sockets=1) as machine:
        sockets = (machine.socket, machine.more[0])
        observer = Observer(machine)
        observer.start()
        try:
            for i in range(PAIRS):
                order = draw.sample(sockets, 2)
                runs = [Run(s, draw.choice(("auto", "qmp")), tmp_path / f"{i}-{n}.folded")
                        for n, s in enumerate(order)]  # fmt: skip
                runs[0].start()
                time.sleep(draw.uniform(0, 1.5))  # the second's start, at a random offset
                runs[1].start()
                try:
                    refused += check_pair(runs[0], runs[1], pauses)
                finally:
                    for run in runs:
                        run.kill()
        finally:
            observer.done.set()
            observer.join()
        assert observer.looks > PAIRS
        # The private gdbstub's attach and removal stop the guest too, and no run reports
        # those: the observer's view is the one held to the bound, whatever stopped the guest.
        assert observer.longest < LONGEST_STOP, (observer.longest, pauses)
        assert machine.witness.execute("query-status")["status"] == "running"
        assert "gdb" not in machine.chardevs()
        with pytest.raises(TransportError, match="not found"):
            machine.witness.execute(
                "qom-get", {"path": f"/objects/{MARK_ID}", "property": "identity"}
            )
    assert refused >= 1, "no two runs overlapped: the test showed nothing"
    print(f"{refused} of {PAIRS} pairs overlapped and one refused; longest stop"
          f" {observer.longest:.3f} s over {observer.looks} looks, longest pause of a run"
          f" {max(pauses):.3f} s")  # fmt: skip


def sampling(run: Run, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while run.sampling_at is None:
        assert run.process is not None and run.process.poll() is None, run.err
        assert time.monotonic() < deadline, run.err
        time.sleep(0.01)


@pytest.mark.parametrize("transport", ["auto", "qmp"])
def test_a_guest_another_client_stopped_ends_the_run_and_stays_stopped(
    tmp_path: Path, transport: str, request: pytest.FixtureRequest
) -> None:
    """Another QMP client stops the guest mid-run and holds it: the run ends at its next tick,
    says why in one line, writes what it collected and leaves the guest stopped. (A stop that
    lands inside one of qmpprof's pauses changes nothing in QEMU, and qmpprof's cont ends it: so
    the other client stops again until the run has ended.)"""
    with vm(tmp_path, smp=1, more_sockets=1) as machine:
        run = Run(machine.socket, transport, tmp_path / "held.folded", duration=60)
        run.start()
        request.addfinalizer(run.kill)
        sampling(run)
        wait_stops(machine.more[0], PAUSES, 60)  # some ticks first: the run has something to write
        held_at = time.monotonic()
        while run.ended_at is None and time.monotonic() < held_at + 30:
            machine.witness.execute("stop")
            time.sleep(0.02)
        code = run.wait()
        assert run.ended_at is not None
        ended_after = run.ended_at - held_at
        assert code == 5, run.err
        last = run.err.splitlines()[-1]
        assert last == ("qmpprof: error: something else stopped the guest (QEMU says paused):"
                        " the run ends here, and leaves it so"), run.err  # fmt: skip
        assert sum(c for _, c in folded.parse(run.out.read_text())) > 0
        assert machine.witness.execute("query-status")["status"] == "paused"
        assert "gdb" not in machine.chardevs()
        machine.witness.execute("cont")
        assert machine.advances()
    assert ended_after < 5, run.err
