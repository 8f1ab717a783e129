"""The transport registry's choice: the first kind, in registry order, that an address given
suits (``auto``), or the kind named, refused when it cannot use the addresses given."""

from __future__ import annotations

from pathlib import Path

import pytest

from qmpprof import transport
from qmpprof.errors import UsageError
from qmpprof.transport.base import Reach

SOCKET = Path("/run/vm/qmp")
TCP = ("vmhost", 4444)


@pytest.mark.parametrize(
    ("reach", "name", "passed_over"),
    [
        (Reach(SOCKET), "private-gdb", "gdb needs a gdbstub address, not a QMP Unix socket"),
        (
            Reach(qmp_tcp=TCP),
            "qmp",
            "private-gdb needs a QMP Unix socket, not QMP over TCP",
        ),
        (Reach(SOCKET, gdb="localhost:1234", transport="gdb"), "gdb", None),
        (Reach(SOCKET, gdb="localhost:1234"), "gdb", None),
        (Reach(qmp_tcp=TCP, transport="qmp"), "qmp", None),
        (Reach(SOCKET, transport="private-gdb"), "private-gdb", None),
        (
            Reach(domain="web1"),
            "libvirt",
            "qmp needs QMP over TCP or a QMP Unix socket, not a libvirt domain",
        ),
        (Reach(domain="web1", transport="libvirt"), "libvirt", None),
    ],
)
def test_the_kind_chosen(reach: Reach, name: str, passed_over: str | None) -> None:
    kind, why = transport.choose(reach)
    assert (kind.name, why) == (name, passed_over)


@pytest.mark.parametrize(
    ("reach", "message"),
    [
        (Reach(transport="ssh"), "not one of auto, gdb, private-gdb, qmp, libvirt"),
        (Reach(qmp_tcp=TCP, transport="private-gdb"), "needs a QMP Unix socket"),
        (Reach(transport="gdb"), "--transport gdb needs a gdbstub address"),
        (Reach(domain="web1", transport="private-gdb"), "needs a QMP Unix socket"),
        (Reach(SOCKET, transport="libvirt"), "--transport libvirt needs a libvirt domain"),
    ],
)
def test_a_kind_that_cannot_serve_is_refused(reach: Reach, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        transport.choose(reach)


def test_where_names_the_address_the_run_goes_to() -> None:
    assert Reach(SOCKET).where == str(SOCKET)
    assert Reach(qmp_tcp=TCP).where == "vmhost:4444"
    assert Reach(SOCKET, gdb="localhost:1234", transport="gdb").where == "localhost:1234"
    assert Reach(domain="web1", connect="qemu:///system").where == "domain web1"
