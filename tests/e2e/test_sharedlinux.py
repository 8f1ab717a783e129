"""The check a shared guest passes between tests (tests/sharedlinux.py), on the bundled guest:
each way a test can leave a guest wrong is told, and a guest left right is paused for the next
test."""

from __future__ import annotations

import pytest
from guestvm import Guest
from qemus import every_qemu
from sharedlinux import what_is_wrong
from support.bench.rawqmp import RawQmp

from qmpprof.transport.vmmark import MARK_ID

pytestmark = [pytest.mark.qemu, every_qemu]

# Long enough for QEMU's greeting to an only client, even on a loaded host; past it, a client
# left connected is what keeps the greeting from coming.
GREETING = 5.0


def test_each_wrong_state_a_test_can_leave_is_told(guest: Guest) -> None:
    assert what_is_wrong(guest, GREETING) == ""
    with RawQmp(str(guest.qmp_socket)) as qmp:
        assert not qmp.running()  # the check paused the guest it passed
    assert what_is_wrong(guest, GREETING) == "not running (paused)"
    with RawQmp(str(guest.qmp_socket)) as qmp:
        qmp.execute("cont")
        qmp.execute("object-add", {"qom-type": "authz-simple", "id": MARK_ID, "identity": "me"})
    assert what_is_wrong(guest, GREETING) == "marked by a qmpprof run (me)"
    with RawQmp(str(guest.qmp_socket)) as qmp:
        qmp.execute("object-del", {"id": MARK_ID})
        assert what_is_wrong(guest, GREETING) == "with a QMP client still connected"
    guest.process.kill()
    guest.process.wait()
    assert what_is_wrong(guest, GREETING) == "dead (QEMU exited)"
