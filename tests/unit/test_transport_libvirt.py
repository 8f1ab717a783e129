"""libvirt's monitor passthrough as a QMP client (transport/libvirtdomain.py), against a scripted
stand-in for libvirt-qemu's qemuMonitorCommand: the JSON sent, replies and QEMU's refusals, the
stops it counts as STOP events, and libvirt's errors as qmpprof's; the files a domain boots, read
from its XML through libvirt's test driver. The real libvirtd is test_libvirt_e2e.py's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import libvirt
import pytest

import qmpprof.transport.libvirtdomain as libvirtdomain
from qmpprof.errors import GuestGoneError, TransportError
from qmpprof.transport import BootFiles, boot_files
from qmpprof.transport.base import Reach
from qmpprof.transport.libvirtdomain import PassthroughClient


class Connection:
    """What the client asks of a virConnect."""

    def __init__(self, alive: bool = True) -> None:
        self.alive = alive

    def isAlive(self) -> int:  # libvirt's name
        return int(self.alive)


def scripted(
    monkeypatch: pytest.MonkeyPatch, answer: Callable[[dict[str, object]], str]
) -> list[dict[str, object]]:
    """qemuMonitorCommand answering each command by ``answer``; the commands sent, in order."""
    sent: list[dict[str, object]] = []

    def command(domain: object, text: str, flags: int) -> str:
        assert flags == 0
        sent.append(json.loads(text))
        return answer(sent[-1])

    monkeypatch.setattr(libvirtdomain.libvirt_qemu, "qemuMonitorCommand", command)
    return sent


class Domain:
    """What the client asks of a virDomain."""

    def __init__(self, active: bool = True) -> None:
        self.active = active

    def isActive(self) -> int:  # libvirt's name
        return int(self.active)


def client(alive: bool = True, active: bool = True) -> PassthroughClient:
    return PassthroughClient(Connection(alive), Domain(active))  # type: ignore[arg-type]


async def test_a_command_goes_as_qmp_json_and_its_return_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent = scripted(monkeypatch, lambda _: '{"return": {"arch": "x86_64"}, "id": "libvirt-9"}')
    assert await client().execute("query-target") == {"arch": "x86_64"}
    assert await client().execute("memsave", {"val": 4096, "size": 8}) == {"arch": "x86_64"}
    assert sent == [
        {"execute": "query-target"},
        {"execute": "memsave", "arguments": {"val": 4096, "size": 8}},
    ]


async def test_qemus_refusal_keeps_its_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # memsave's "Invalid addr" is how QmpTransport tells an unmapped address from a failure.
    refusal = {"error": {"class": "GenericError", "desc": "Invalid addr 0x0/8 specified"}}
    scripted(monkeypatch, lambda _: json.dumps(refusal))
    with pytest.raises(TransportError, match=r"^QEMU refused memsave: Invalid addr 0x0/8"):
        await client().execute("memsave", {"val": 0, "size": 8})


@pytest.mark.parametrize(("status", "counted"), [("running", 1), ("paused", 0)])
async def test_a_stop_counts_as_a_stop_event_when_the_guest_ran(
    monkeypatch: pytest.MonkeyPatch, status: str, counted: int
) -> None:
    def answer(message: dict[str, object]) -> str:
        if message["execute"] == "query-status":
            return json.dumps({"return": {"status": status}})
        return '{"return": {}}'

    sent = scripted(monkeypatch, answer)
    passthrough = client()
    await passthrough.execute("stop")
    assert [m["execute"] for m in sent] == ["query-status", "stop"]
    assert passthrough.stops == counted


@pytest.mark.parametrize(
    ("code", "alive", "error"),
    [
        (libvirt.VIR_ERR_OPERATION_INVALID, True, GuestGoneError),  # "domain is not running"
        (libvirt.VIR_ERR_NO_DOMAIN, True, GuestGoneError),
        (libvirt.VIR_ERR_INTERNAL_ERROR, False, GuestGoneError),  # the daemon went away
        (libvirt.VIR_ERR_INTERNAL_ERROR, True, TransportError),
        # the monitor's end of file as the domain is destroyed: the domain says it is gone
        (libvirt.VIR_ERR_INTERNAL_ERROR, None, GuestGoneError),
    ],
)
async def test_libvirts_errors_become_qmpprofs(
    monkeypatch: pytest.MonkeyPatch, code: int, alive: bool | None, error: type[Exception]
) -> None:
    def refuse(message: dict[str, object]) -> str:
        err = libvirt.libvirtError("refused")
        err.err = (code, 0, "it says no", 0, "", None, None, 0, 0)
        raise err

    scripted(monkeypatch, refuse)
    with pytest.raises(error, match="it says no") as raised:
        await client(alive is not False, active=alive is not None).execute("cont")
    assert type(raised.value) is error


def node(folder: Path, kernel: str | None, initrd: str | None = None) -> str:
    """A libvirt test-driver URI whose node holds one running domain, "vm", booting ``kernel``
    and ``initrd`` directly (None: not named)."""
    files = "".join(
        f"<{tag}>{path}</{tag}>" for tag, path in (("kernel", kernel), ("initrd", initrd)) if path
    )
    xml = folder / "node.xml"
    xml.write_text(
        "<node><domain type='test'><name>vm</name><memory>65536</memory>"
        f"<os><type>hvm</type>{files}</os></domain></node>"
    )
    return f"test://{xml}"


def test_a_domain_names_the_kernel_and_initrd_it_boots(tmp_path: Path) -> None:
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    kernel.write_bytes(b"k")
    initrd.write_bytes(b"i")
    found = boot_files(Reach(domain="vm", connect=node(tmp_path, str(kernel), str(initrd))))
    assert found == BootFiles(kernel, initrd)


def test_a_file_this_host_cannot_read_is_said_not_taken(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    found = boot_files(Reach(domain="vm", connect=node(tmp_path, str(gone))))
    assert found == BootFiles(
        notes=(f"domain vm boots {gone} (its <kernel>), which this user cannot read",)
    )


def test_a_domain_booting_from_its_disk_names_nothing(tmp_path: Path) -> None:
    assert boot_files(Reach(domain="vm", connect=node(tmp_path, None))) == BootFiles()
    assert boot_files(Reach(domain="other", connect=node(tmp_path, None))) == BootFiles()
    assert boot_files(Reach(qmp_socket=tmp_path / "qmp")) == BootFiles()  # no domain: no XML


@pytest.mark.parametrize(
    ("uri", "host"),
    [
        ("qemu:///system", None),
        ("qemu:///system?socket=/tmp/lv/run/libvirt-sock", None),
        ("test:///default", None),
        ("qemu+ssh://root@kvm7.example.org/system", "kvm7.example.org"),
        ("qemu+tcp://10.0.0.2:16509/system", "10.0.0.2"),
        ("qemu+ssh://localhost/system", None),
    ],
)
def test_a_domain_on_another_host_is_told_by_its_uri(uri: str, host: str | None) -> None:
    assert libvirtdomain.remote_host(uri) == host


def test_a_domain_on_another_host_names_no_file_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = node(tmp_path, "/boot/vmlinuz")
    real_open = libvirt.openReadOnly

    class Remote:
        def __init__(self) -> None:
            self.connection = real_open(uri)

        def __getattr__(self, name: str) -> object:
            return getattr(self.connection, name)

        def getURI(self) -> str:  # libvirt's name
            return "qemu+ssh://kvm7.example.org/system"

    monkeypatch.setattr(libvirtdomain.libvirt, "openReadOnly", lambda _: Remote())
    found = boot_files(Reach(domain="vm", connect=uri))
    assert found == BootFiles(notes=("domain vm boots files on kvm7.example.org: give --kernel",))
