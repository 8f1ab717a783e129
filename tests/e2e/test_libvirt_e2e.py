"""``--domain`` end to end: the bundled guest as a domain of a real libvirtd (tests/libvirtvm.py),
profiled by the real command line through libvirt's monitor passthrough, and through a QMP socket
of the same QEMU for comparison. The processes sampled and their shares agree within sampling
noise; libvirt reports the domain in the state it had (running, and a paused one paused); nothing
of qmpprof's stays in QEMU (no gdbstub chardev, no qmpprof-run mark, asked through passthrough);
runs ended at random instants by SIGINT, SIGTERM, SIGKILL (inside a pause: the guard resumes the
domain through libvirt) and virsh destroy leave it as libvirt had it.

On the host's QEMU only: Debian 12's libvirt 9.0 cannot probe the capabilities of the unpacked
QEMU 11.1 ("Unable to read from monitor: Connection reset by peer"), so it refuses to start a
domain with it."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import libvirt
import pytest
from guestelf import elf_symbols
from libvirtvm import Domain, leftovers, libvirt_daemon, passthrough, running_domain

from qmpprof.output import folded

pytestmark = [pytest.mark.qemu]

DURATION = "1"  # seconds of guest run time: 100 ticks at the default 10 ms
RUNS = 20  # ended at random instants: by each signal in turn, the last by virsh destroy
LATEST = 0.5  # seconds after sampling began: the latest random instant
FREEZES = 400  # tries at freezing qmpprof inside a pause (at a 1 ms interval, most do)
SHARE_NOISE = 0.25  # 100 samples: a share's standard error is at most 0.05, a difference's 0.07


@pytest.fixture(scope="module")
def uri() -> Iterator[str]:
    with libvirt_daemon() as found:
        yield found


@pytest.fixture
def domain(uri: str) -> Iterator[Domain]:
    with running_domain(uri, shutil.which("qemu-system-x86_64") or "qemu-system-x86_64") as dom:
        yield dom


def qmpprof(*args: str) -> list[str]:
    return [sys.executable, "-m", "qmpprof", *args]


@dataclass
class Profiled:
    shares: dict[str, float]  # each process's share of the samples
    kernel: set[str]  # the kernel functions sampled
    stderr: str


def profile(domain: Domain, out: Path, *reach: str) -> Profiled:
    """A run of DURATION through ``reach`` (``--kernel`` among them or not)."""
    argv = qmpprof(*reach, "--duration", DURATION, "--user-dir", str(domain.user_dir),
                   "-o", str(out))  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    counts: Counter[str] = Counter()
    for stack, count in folded.parse(out.read_text()):
        counts[stack[0]] += count
    total = sum(counts.values())
    frames = {f.removesuffix("_[k]") for stack, _ in folded.parse(out.read_text()) for f in stack}
    return Profiled(
        {process: count / total for process, count in counts.items()},
        frames & set(elf_symbols(domain.kernel)),
        done.stderr,
    )


def test_a_domain_profiles_as_its_qmp_socket_and_is_left_as_found(
    domain: Domain, tmp_path: Path
) -> None:
    connection = libvirt.open(domain.uri)
    machine = connection.lookupByName(domain.name)
    before = machine.state()
    assert before[0] == libvirt.VIR_DOMAIN_RUNNING
    # No --kernel: the domain's XML names the kernel it boots, and qmpprof takes it from there.
    by_domain = profile(domain, tmp_path / "domain.folded", "--domain", domain.name,
                        "--connect", domain.uri)  # fmt: skip
    said = f"qmpprof: note: --kernel {domain.kernel}: the kernel domain {domain.name} boots"
    assert said in by_domain.stderr.splitlines() and "no --kernel" not in by_domain.stderr
    assert machine.state()[0] == before[0]  # the reason: unpaused, after qmpprof's resumes
    assert leftovers(machine) == []
    machine.suspend()
    paused = machine.state()
    out = tmp_path / "paused.folded"
    argv = qmpprof("--domain", domain.name, "--connect", domain.uri, "--one-shot", "-o", str(out))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert machine.state() == paused, done.stderr
    status = passthrough(machine, "query-status")
    assert isinstance(status, dict) and status["status"] == "paused"  # QEMU's word, not libvirt's
    assert leftovers(machine) == []
    machine.resume()

    by_socket = profile(domain, tmp_path / "socket.folded", "--qmp-socket", str(domain.witness),
                        "--kernel", str(domain.kernel))  # fmt: skip
    shares, theirs = by_domain.shares, by_socket.shares
    common = {p for p, share in shares.items() if share >= 0.1}
    assert common == {p for p, share in theirs.items() if share >= 0.1}, (shares, theirs)
    assert common, shares
    for process in common:
        assert abs(shares[process] - theirs[process]) <= SHARE_NOISE, process
    # Kernel code named by the domain's own kernel as by the one given: some in both runs
    assert by_domain.kernel and by_socket.kernel, (by_domain.kernel, by_socket.kernel)

    connection.close()


def sampling(run: subprocess.Popen[str]) -> None:
    """Read ``run``'s standard error up to the line saying it samples; fail with what it said
    instead when it ends first."""
    assert run.stderr is not None
    said = []
    for line in run.stderr:
        if line.startswith("qmpprof: sampling"):
            return
        said.append(line)
    raise AssertionError(f"qmpprof ended before sampling: {''.join(said)}")


def in_a_pause(run: subprocess.Popen[str], machine: libvirt.virDomain) -> bool:
    """Freeze qmpprof (SIGSTOP) at instants until one finds the guest stopped: qmpprof is then
    inside one of its pauses; it stays frozen there. False when FREEZES found none."""
    for _ in range(FREEZES):
        if run.poll() is not None:
            return False  # it ended: what it said tells why
        os.kill(run.pid, signal.SIGSTOP)
        status = passthrough(machine, "query-status")
        if isinstance(status, dict) and status.get("status") in ("paused", "debug"):
            return True
        os.kill(run.pid, signal.SIGCONT)
    return False


def test_runs_ended_at_random_instants_leave_the_domain_as_found(
    domain: Domain, tmp_path: Path
) -> None:
    """RUNS runs ended by SIGINT, SIGTERM and SIGKILL in turn at random instants once sampling,
    each SIGKILL inside a pause (qmpprof frozen where the guest stands stopped: the pause guard
    must resume it), and one by ``virsh destroy``: libvirt reports the domain running after
    each, nothing of qmpprof's left in QEMU, and the destroyed run ends in one line, exit 4."""
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    instants = random.Random(seed)
    connection = libvirt.open(domain.uri)
    machine = connection.lookupByName(domain.name)
    # A 1 ms interval: the guest stands stopped much of the time, so that the instants land
    # inside pauses as often as between them.
    argv = qmpprof("--domain", domain.name, "--connect", domain.uri, "--duration", "60",
                   "--interval", "1", "-o", str(tmp_path / "cut.folded"))  # fmt: skip
    cuts = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    resumed = 0
    for run_number in range(RUNS - 1):
        cut = cuts[run_number % len(cuts)]
        with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as run:
            sampling(run)
            if cut == signal.SIGKILL:
                if not in_a_pause(run, machine):
                    raise AssertionError(f"no freeze found the guest stopped: {run.stderr.read()}")
            else:
                time.sleep(instants.uniform(0, LATEST))  # the random instant, not a wait
            os.kill(run.pid, cut)
            # To the end of qmpprof's standard error: its guard's too, which holds it open
            # until it has resumed the guest (or found nothing to do) and exited.
            said = run.stderr.read()
            code = run.wait()
        assert code in (0, 128 + cut, -signal.SIGKILL), (cut, code, said)
        assert "Traceback" not in said, said
        resumed += "the guest (" in said and "runs again" in said
        assert machine.state()[0] == libvirt.VIR_DOMAIN_RUNNING, (cut, said)
        assert leftovers(machine) == [], (cut, said)
    assert resumed == len(range(2, RUNS - 1, len(cuts)))  # the guard, after every SIGKILL

    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as run:
        sampling(run)
        machine.destroy()
        said = run.stderr.read()
        code = run.wait(timeout=60)
    errors = [line for line in said.splitlines() if line.startswith("qmpprof: error")]
    assert code == 4 and len(errors) == 1 and "Traceback" not in said, said
    assert machine.state()[0] == libvirt.VIR_DOMAIN_SHUTOFF
    connection.close()
