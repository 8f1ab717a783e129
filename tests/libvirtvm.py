"""A real libvirt for the tests: Debian's libvirtd (with its QEMU driver) and virtlogd, started as
root in a mount namespace of their own, where libvirt's fixed directories (/run/libvirt,
/var/lib/libvirt, /var/cache/libvirt, /var/log/libvirt, /etc/libvirt) are a test directory's:
their own sockets and state, none of the host's. The host's libvirt, if any, is not touched.

``libvirt_daemon`` yields the connection URI (``qemu:///system?socket=...``); ``running_domain``
defines the bundled guest as a domain from XML (``type='qemu'``: TCG; the bundled kernel through
``<kernel>``; the serial console into a file; one more QMP socket, the test's witness, through
``<qemu:commandline>``), starts it, waits for the workload and undefines it at the end.

Facts of Debian 12's libvirt 9.0 this relies on (checked there): the QEMU driver resolves its
default user ``libvirt-qemu`` at start even when qemu.conf names root (the namespace gets a passwd
and group holding it: the host's are not changed); QEMU runs as root here so that the private
gdbstub's 0700 directory and memsave's files are its to use, as for a root user's own QEMU.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import libvirt
import libvirt_qemu
from guestvm import BOOT_TIMEOUT, BUILD_ROOT, WORKLOAD_LINE, build_fixtures

from qmpprof.transport.vmmark import MARK_ID

_DIRS = {
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "cache": "/var/cache/libvirt",
    "log": "/var/log/libvirt",
    "etc": "/etc/libvirt",
}
_QEMU_CONF = """user = "root"
group = "root"
dynamic_ownership = 0
security_driver = "none"
namespaces = []
stdio_handler = "logd"
"""
_START = """set -e
for pair in {pairs}; do
    mkdir -p "${{pair#*:}}"
    mount --bind "{root}/${{pair%%:*}}" "${{pair#*:}}"
done
mount --bind {root}/passwd /etc/passwd
mount --bind {root}/group /etc/group
virtlogd --pid-file {root}/virtlogd.pid &
exec libvirtd --pid-file {root}/libvirtd.pid
"""
# The daemon probes the emulator's capabilities on its first domain: seconds on a loaded machine.
DAEMON_TIMEOUT = 30.0


@dataclass(frozen=True)
class Domain:
    name: str
    uri: str
    console: Path
    witness: Path  # a QMP socket of the test's own, beside libvirt's monitor
    kernel: Path
    user_dir: Path


def _wait(done: Callable[[], bool], what: str, timeout: float) -> None:
    """Until ``done`` holds, looked at every 50 ms; TimeoutError saying ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


@contextlib.contextmanager
def libvirt_daemon() -> Iterator[str]:
    """libvirtd and virtlogd in a private namespace; yields the URI that reaches them."""
    root = Path(tempfile.mkdtemp(prefix="lv-", dir="/tmp"))
    for name in _DIRS:
        (root / name).mkdir()
    (root / "etc" / "qemu.conf").write_text(_QEMU_CONF)
    (root / "passwd").write_text(
        Path("/etc/passwd").read_text() + "libvirt-qemu:x:64055:64055::/nonexistent:/bin/false\n"
    )
    (root / "group").write_text(Path("/etc/group").read_text() + "libvirt-qemu:x:64055:\n")
    pairs = " ".join(f"{name}:{path}" for name, path in _DIRS.items())
    script = _START.format(pairs=pairs, root=root)
    log = (root / "daemon.log").open("w")
    process = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    socket = root / "run" / "libvirt-sock"
    try:
        _wait(lambda: socket.is_socket() or process.poll() is not None, "no libvirtd", 30.0)
        if process.poll() is not None:
            raise RuntimeError(f"libvirtd ended: {(root / 'daemon.log').read_text()[-2000:]}")
        yield f"qemu:///system?socket={socket}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)  # libvirtd stops; virtlogd goes below
        process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # virtlogd, in libvirtd's session
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def domain_xml(name: str, emulator: str, kernel: Path, console: Path, witness: Path) -> str:
    return f"""<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{escape(name)}</name>
  <memory unit='MiB'>128</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{escape(str(kernel))}</kernel>
  </os>
  <on_reboot>destroy</on_reboot>
  <devices>
    <emulator>{escape(emulator)}</emulator>
    <serial type='file'><source path='{escape(str(console))}'/></serial>
    <memballoon model='none'/>
  </devices>
  <qemu:commandline>
    <qemu:arg value='-qmp'/>
    <qemu:arg value='unix:{escape(str(witness))},server=on,wait=off'/>
  </qemu:commandline>
</domain>"""


@contextlib.contextmanager
def running_domain(
    uri: str, emulator: str, variant: str = "cfi", name: str = "qmpprof-guest"
) -> Iterator[Domain]:
    """The bundled guest as the libvirt domain ``name``, running its workload; destroyed and
    undefined at the end."""
    build_fixtures((variant,))
    where = Path(tempfile.mkdtemp(prefix="lvd-", dir="/tmp"))
    build = BUILD_ROOT / variant
    domain = Domain(
        name, uri, where / "console.txt", where / "witness.sock",
        build / "kernel.elf", build / "user",
    )  # fmt: skip
    xml = domain_xml(domain.name, emulator, domain.kernel, domain.console, domain.witness)
    connection = libvirt.open(uri)
    machine = connection.defineXML(xml)
    try:
        # The first start probes the emulator (DAEMON_TIMEOUT), then the guest boots.
        machine.create()
        _wait(
            lambda: domain.console.exists() and WORKLOAD_LINE in domain.console.read_text(),
            "the workload never started",
            BOOT_TIMEOUT + DAEMON_TIMEOUT,
        )
        yield domain
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            machine.destroy()
        machine.undefine()
        connection.close()
        shutil.rmtree(where, ignore_errors=True)


def passthrough(machine: libvirt.virDomain, command: str, **arguments: object) -> object:
    """A QMP command through libvirt's monitor passthrough; its ``return``."""
    text = json.dumps({"execute": command, "arguments": arguments})
    return json.loads(libvirt_qemu.qemuMonitorCommand(machine, text, 0))["return"]


def qemu_state(machine: libvirt.virDomain) -> str:
    """QEMU's own word (query-status), beside libvirt's ``state()``."""
    status = passthrough(machine, "query-status")
    assert isinstance(status, dict)
    return str(status["status"])


def leftovers(machine: libvirt.virDomain) -> list[str]:
    """What of qmpprof's QEMU holds: the mark object, a gdbstub chardev."""
    objects = passthrough(machine, "qom-list", path="/objects")
    chardevs = passthrough(machine, "query-chardev")
    assert isinstance(objects, list) and isinstance(chardevs, list)
    return [o["name"] for o in objects if o["name"] == MARK_ID] + [
        c["label"] for c in chardevs if c["label"] == "gdb"
    ]
