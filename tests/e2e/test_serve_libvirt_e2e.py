"""``serve --libvirt URI`` end to end: a real libvirtd (tests/libvirtvm.py) running the bundled
guest as domains, serve as a process of its own. A domain paused before serve is followed and
stays paused; a domain started during serve gets its profile under its domain name (the metrics
and the flame graph serve answers), leaves the list when destroyed and comes back when started
again; SIGTERM leaves each domain in the state it had (one running, one paused) with nothing of
qmpprof's in QEMU. What libvirt and QEMU report is the truth compared against.

On the host's QEMU only, as test_libvirt_e2e.py (Debian 12's libvirt 9.0 cannot probe QEMU 11.1).
"""

from __future__ import annotations

import html
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import libvirt
import pytest
from guestelf import elf_symbols
from guestvm import expected
from libvirtvm import Domain, leftovers, libvirt_daemon, qemu_state, running_domain
from servepages import Served, get, serve_command

pytestmark = [pytest.mark.qemu]

EMULATOR = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
FOLLOW_TIMEOUT = 60.0  # seconds for serve to see a domain start or stop and sample it


@contextmanager
def serving(uri: str, guest: Domain) -> Iterator[Served]:
    # No --kernel: each domain's own, as its XML names it.
    with serve_command(
        "--libvirt", uri, "--user-dir", str(guest.user_dir),
        "--max-overhead", "none", "--interval", "20",
    ) as served:  # fmt: skip
        yield served


def wait_until(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + FOLLOW_TIMEOUT
    while not check():
        assert time.monotonic() < deadline, f"not within {FOLLOW_TIMEOUT:g} s: {what}"
        time.sleep(0.2)


def test_serve_follows_the_domains_as_they_start_and_stop_and_leaves_each_as_it_was() -> None:
    functions = set(expected()["programs"]["spin"]["shares"])
    with (
        libvirt_daemon() as uri,
        running_domain(uri, EMULATOR, name="held") as held,
    ):
        connection = libvirt.open(uri)
        held_machine = connection.lookupByName("held")
        held_machine.suspend()
        with serving(uri, held) as served:
            wait_until("held followed", lambda: served.per_vm("qmpprof_vm_up") == {"held": 0})
            with running_domain(uri, EMULATOR, name="came") as came:
                wait_until("came sampled", lambda: served.samples().get("came", 0) > 0)
                status, kind, svg = get(served.url + "flamegraph.svg?vm=came&seconds=5")
                assert (status, kind) == (200, "image/svg+xml"), svg[:200]
                words = set(re.findall(r"\w+", svg.decode()))
                assert functions & words, svg[:2000]
                # Its kernel named by the kernel its XML boots, which the index says it took.
                assert set(elf_symbols(came.kernel)) & words, svg[:2000]
                page = get(served.url)[2].decode()
                note = f"note: --kernel {came.kernel}: the kernel domain came boots"
                assert html.escape(note) in page, page
                came_machine = connection.lookupByName(came.name)
                came_machine.destroy()
                wait_until("came dropped", lambda: "came" not in served.samples())
                assert get(served.url + "flamegraph.svg?vm=came")[0] == 404
                came_machine.create()  # the same domain again: followed afresh
                wait_until("came back", lambda: served.samples().get("came", 0) > 0)
                assert served.samples()["held"] == 0
                assert held_machine.state()[0] == libvirt.VIR_DOMAIN_PAUSED
                served.proc.send_signal(signal.SIGTERM)
                _, err = served.proc.communicate(timeout=60)
                assert served.proc.returncode == 0, err
                assert came_machine.state()[0] == libvirt.VIR_DOMAIN_RUNNING
                assert qemu_state(came_machine) == "running"
                assert leftovers(came_machine) == []
        assert held_machine.state()[0] == libvirt.VIR_DOMAIN_PAUSED
        assert qemu_state(held_machine) == "paused"
        assert leftovers(held_machine) == []
        connection.close()
