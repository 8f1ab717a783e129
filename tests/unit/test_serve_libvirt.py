"""serve --libvirt's domain set: domains followed as they start, named by their domain name and
reached through libvirt, dropped as they stop, looked up again at libvirt's lifecycle events
rather than on a clock; bad input is one line and an exit code. libvirt's own test driver
(``test:///default``, in the client library: no daemon) stands in for a host's libvirtd; the
VMs' threads are replaced by done futures (no guest here: tests/e2e/test_serve_libvirt_e2e.py
has the real ones)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import libvirt
import pytest

from qmpprof.cli import main
from qmpprof.cli.serve import parse
from qmpprof.errors import ConnectError
from qmpprof.serve import daemon
from qmpprof.serve.vm import Vm
from qmpprof.transport import watch_domains

URI = "test:///default"  # one running domain, "test", shared by the process's connections
EVENT_TIMEOUT = 10.0  # seconds; an event comes in milliseconds


class FakeDomains:
    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.closed = False

    def running(self) -> frozenset[str]:
        return frozenset(self.names)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def no_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Vm]]:
    """The VMs the daemon starts, none of them run."""
    started: list[Vm] = []

    def in_thread(vm: Vm) -> asyncio.Future[None]:
        started.append(vm)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    monkeypatch.setattr(daemon, "in_thread", in_thread)
    yield started


async def test_domains_are_followed_by_name_as_they_start_and_dropped_as_they_stop(
    no_threads: list[Vm],
) -> None:
    served = daemon.Daemon(parse(["--libvirt", "qemu:///x", "--interval", "20"]))
    domains = FakeDomains({"web", "db"})
    served.domains = domains
    served.follow_domains()
    assert [vm.name for vm in served.board.vms] == ["db", "web"]
    assert [(vm.reach.domain, vm.reach.connect) for vm in no_threads] == [
        ("db", "qemu:///x"),
        ("web", "qemu:///x"),
    ]
    assert no_threads[0].spec.reach.domain == "db" and no_threads[0].spec.sampling.interval == 0.02
    domains.names = {"web", "cache"}
    served.follow_domains()
    assert sorted(vm.name for vm in served.board.vms) == ["cache", "web"]
    assert no_threads[0]._asked.is_set()  # db's sampler told to stop after its tick
    assert not no_threads[1]._asked.is_set()
    served.follow_domains()  # nothing changed: nobody started or stopped again
    assert len(no_threads) == 3


async def test_a_lifecycle_event_wakes_the_daemon_with_no_clock(no_threads: list[Vm]) -> None:
    """The real watch on libvirt's test driver: destroying and starting a domain from another
    connection updates the VMs, with no --qmp-dir (so no rescan timer) to fall back on."""
    served = daemon.Daemon(parse(["--libvirt", URI]))
    served._watch()
    other = libvirt.open(URI)
    try:
        served.follow_domains()
        assert [vm.name for vm in served.board.vms] == ["test"]
        look = asyncio.create_task(served._look())
        await asyncio.sleep(0)  # the look waits for news
        await asyncio.to_thread(other.lookupByName("test").destroy)
        await asyncio.wait_for(look, EVENT_TIMEOUT)
        assert served.board.vms == ()
        look = asyncio.create_task(served._look())
        await asyncio.to_thread(other.lookupByName("test").create)
        await asyncio.wait_for(look, EVENT_TIMEOUT)
        assert [vm.name for vm in served.board.vms] == ["test"]
    finally:
        if not other.lookupByName("test").isActive():
            other.lookupByName("test").create()
        other.close()
        assert served.domains is not None
        served.domains.close()


def test_the_watch_calls_back_from_libvirts_event_thread() -> None:
    called = threading.Event()
    watch = watch_domains(URI, called.set)
    other = libvirt.open(URI)
    try:
        assert watch.running() == {"test"}
        other.lookupByName("test").suspend()
        assert called.wait(EVENT_TIMEOUT)
        assert watch.running() == {"test"}  # a paused domain still runs: it is followed
    finally:
        other.lookupByName("test").resume()
        other.close()
        watch.close()


def test_a_uri_libvirt_refuses_is_one_line_and_exit_3(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ConnectError):
        watch_domains("qemu:///system?socket=/nonexistent/libvirt-sock", lambda: None)
    assert main(["serve", "--libvirt", "qemu:///system?socket=/nonexistent/sock"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qmpprof: error: libvirt qemu:///system")


@pytest.mark.parametrize(
    "args",
    [
        ["--qmp-socket", "/tmp/vm1.sock"],
        ["--qmp-dir", "/tmp"],
    ],
)
def test_libvirt_with_sockets_is_one_line_and_exit_2(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--libvirt", URI, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--libvirt names every VM" in err


def test_a_socket_in_the_config_is_refused_beside_libvirt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('[vm.web]\nsocket = "web.qmp"\n')
    assert main(["serve", "--libvirt", URI, "--config", str(config)]) == 2
    assert "--libvirt names every VM" in capsys.readouterr().err
