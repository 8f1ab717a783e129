"""Linux test guests shared by the test files that need one: one boot per kind and kernel. Each
kind (``KASLR``, ``CHURN``) is a session fixture in conftest, parametrized by kernel series
(``NOKASLR``: 6.12 only, kept to the session's end): pytest runs the tests of one series
together, from whatever file, and shuts the guest of a series down when it boots the next.
Between tests the guest is paused, so an idle shared guest costs no CPU. ``lent`` hands it to
one test and checks what the test left: running, no QMP client still connected, no qmpprof mark.
A test that leaves it otherwise fails in its own teardown (and the guest is shut down, so the
next test of the series fails at once, saying so). A test that stops the guest by gdb, or needs
another command line, boots its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from guestvm import Booting
from linuxkernel import linux_dir, vmlinux
from linuxvm import CHURN, LinuxGuest, running_linux_guest
from support.bench.rawqmp import RawQmp

from qmpprof.errors import TransportError
from qmpprof.transport.vmmark import MARK_ID

# How long the check after a test waits for QMP's greeting: QEMU greets one client at a time,
# so a client the test left connected keeps it from coming.
GREETING_TIMEOUT = 30.0

# x86_64 KASLR may place the kernel at its link address: the virtual offset is one of ~480 2 MiB
# slots below 1 GiB, slot 0 among them (arch/x86/boot/compressed/kaslr.c; a CI run's 5.10
# guest came up there). A KASLR guest that did not move is booted again, at most this often.
KASLR_BOOTS = 3


@dataclass(frozen=True)
class Kind:
    """A shared guest's command line, besides its kernel: always 2 vCPUs."""

    append: str
    dump_kallsyms: bool
    kaslr: bool = True


# scripts/run-linux-guest boots every guest with no_timer_check (the timer check can fail under
# TCG on a loaded host): the profile tests' own "no_timer_check" was a second copy.
KASLR = Kind("", dump_kallsyms=True)
CHURN_KIND = Kind(CHURN, dump_kallsyms=False)
NOKASLR = Kind("", dump_kallsyms=True, kaslr=False)


@dataclass
class Shared:
    """One shared guest and the series of its kernel; ``gone`` once a test left it broken."""

    series: str
    guest: LinuxGuest
    gone: str = field(default="")

    @property
    def vmlinuz(self) -> Path:
        return linux_dir(self.series) / "vmlinuz"


@contextlib.contextmanager
def booted(tmp_path: Path, kind: Kind, series: str) -> Iterator[Shared]:
    """Boot the kind's guest on the series' kernel, pause it, and yield it; killed at the end."""
    kernel = linux_dir(series) / "vmlinuz"
    moves = kind.kaslr and kind.dump_kallsyms  # a guest whose _text init prints
    image_text = vmlinux(series).section_addr(".text") if moves else None
    for boot in range(1, KASLR_BOOTS + 1):
        with running_linux_guest(
            tmp_path,
            kaslr=kind.kaslr,
            smp=2,
            append=kind.append,
            dump_kallsyms=kind.dump_kallsyms,
            kernel=kernel,
        ) as guest:
            if moves and guest.text_address == image_text and boot < KASLR_BOOTS:
                continue  # KASLR chose the link address: no KASLR guest for the tests
            with RawQmp(str(guest.qmp_socket)) as qmp:
                qmp.execute("stop")
            yield Shared(series, guest)
            return


@contextlib.contextmanager
def lent(shared: Shared) -> Iterator[Shared]:
    """Hand the paused shared guest to a test, running; check and pause it afterwards."""
    if shared.gone:
        pytest.fail(f"the shared guest is gone: {shared.gone}", pytrace=False)
    with RawQmp(str(shared.guest.qmp_socket)) as qmp:
        assert not qmp.running(), "the shared guest ran between tests"
        qmp.execute("cont")
    yield shared
    problem = what_is_wrong(shared.guest)
    if problem:
        shared.gone = f"a test left it {problem}"
        shared.guest.process.kill()
        pytest.fail(f"the test left the shared guest {problem}", pytrace=False)


def what_is_wrong(guest: Booting, greeting_timeout: float = GREETING_TIMEOUT) -> str:
    """What is wrong with a guest a test gave back ("" when nothing: then it is paused)."""
    if guest.process.poll() is not None:
        return "dead (QEMU exited)"
    try:
        qmp = RawQmp(str(guest.qmp_socket), timeout=greeting_timeout)
    except TimeoutError:
        return "with a QMP client still connected"
    with qmp:
        if not qmp.running():
            return f"not running ({qmp.execute('query-status')['status']})"
        try:
            holder = qmp.execute("qom-get", {"path": f"/objects/{MARK_ID}", "property": "identity"})
        except TransportError as err:
            if "not found" not in str(err):  # not found: no run holds the VM
                raise
            holder = None
        if holder is not None:
            return f"marked by a qmpprof run ({holder})"
        qmp.execute("stop")
    return ""
