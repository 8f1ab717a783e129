"""One profiler per VM (transport/vmmark.py): the mark's add, refusal, takeover of a dead run's
mark and removal, against a fake QEMU that keeps objects as QEMU 7.2 and 11.1 answer for them
(their error texts, measured). Live and dead holders are real processes of this host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from qmpprof.errors import TransportError, VmBusyError
from qmpprof.transport import vmmark
from qmpprof.transport.vmmark import MARK_ID, Holder, Mark


class FakeQemu:
    """QEMU's /objects container as QMP sees it, one command at a time."""

    def __init__(self) -> None:
        self.objects: dict[str, str] = {}  # id -> identity
        self.commands: list[str] = []
        self.before_add: list[str] = []  # identities another client adds before our next add

    async def command(self, name: str, args: dict[str, object]) -> object:
        self.commands.append(name)
        if name == "object-add":
            if self.before_add:
                self.objects[MARK_ID] = self.before_add.pop(0)
            key = str(args["id"])
            if key in self.objects:
                raise TransportError(
                    "QEMU refused object-add: attempt to add duplicate property"
                    f" '{key}' to object (type 'container')"
                )
            assert args["qom-type"] == "authz-simple"
            self.objects[key] = str(args["identity"])
            return {}
        if name == "qom-get":
            key = str(args["path"]).removeprefix("/objects/")
            if key not in self.objects:
                raise TransportError(f"QEMU refused qom-get: Device '/objects/{key}' not found")
            return self.objects[key]
        if name == "object-del":
            if self.objects.pop(str(args["id"]), None) is None:
                raise TransportError(f"QEMU refused object-del: object '{args['id']}' not found")
            return {}
        raise AssertionError(f"unexpected command {name}")


def dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


async def test_the_first_run_marks_the_vm_and_removes_its_mark_at_the_end() -> None:
    qemu = FakeQemu()
    mark = await vmmark.take(qemu, "/run/vm/a.sock")
    assert mark.note is None
    assert Holder.parse(qemu.objects[MARK_ID]) == mark.holder
    assert mark.holder.pid == os.getpid() and mark.holder.socket == "/run/vm/a.sock"
    await vmmark.release(qemu, mark)
    assert qemu.objects == {}


async def test_a_second_run_is_refused_naming_the_live_holder() -> None:
    qemu = FakeQemu()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            started = vmmark._start_time(other.pid)
            assert started is not None
            theirs = Holder(other.pid, started, socket.gethostname(), "/run/vm/with space.sock")
            qemu.objects[MARK_ID] = theirs.text()
            with pytest.raises(VmBusyError) as refused:
                await vmmark.take(qemu, "/run/vm/b.sock")
        finally:
            other.kill()
    assert str(refused.value) == (
        f"/run/vm/b.sock: qmpprof pid {other.pid} (through /run/vm/with space.sock)"
        " is profiling this VM: one profiler per VM at a time"
    )
    assert refused.value.exit_code == 3
    assert qemu.objects[MARK_ID] == theirs.text()  # untouched
    assert "object-del" not in qemu.commands


async def test_a_dead_run_s_mark_is_replaced_with_a_note() -> None:
    qemu = FakeQemu()
    gone = Holder(dead_pid(), 12345, socket.gethostname(), "/run/vm/a.sock")
    qemu.objects[MARK_ID] = gone.text()
    mark = await vmmark.take(qemu, "/run/vm/b.sock")
    assert Holder.parse(qemu.objects[MARK_ID]) == mark.holder
    assert mark.note == (
        f"removed the mark of qmpprof pid {gone.pid} (through /run/vm/a.sock),"
        " which ended without removing it"
    )


async def test_a_reused_pid_is_a_dead_run_s() -> None:
    me = Holder.this_run("/run/vm/a.sock")
    assert not me.gone()
    assert Holder(me.pid, me.started + 1, me.host, me.socket).gone()


async def test_another_host_s_mark_is_never_taken_for_dead() -> None:
    qemu = FakeQemu()
    qemu.objects[MARK_ID] = Holder(dead_pid(), 1, "elsewhere", "10.0.0.9:4444").text()
    with pytest.raises(
        VmBusyError, match=r"qmpprof pid \d+ on elsewhere \(through 10.0.0.9:4444\)"
    ):
        await vmmark.take(qemu, "/run/vm/b.sock")


async def test_a_mark_no_qmpprof_wrote_is_someone_s() -> None:
    qemu = FakeQemu()
    qemu.objects[MARK_ID] = "alice"
    with pytest.raises(VmBusyError, match="qmpprof pid 0 on an unknown host"):
        await vmmark.take(qemu, "/run/vm/b.sock")
    assert qemu.objects[MARK_ID] == "alice"


async def test_a_mark_removed_between_the_add_and_the_look_is_taken_on_the_next_add() -> None:
    qemu = FakeQemu()
    theirs = Holder(dead_pid(), 1, socket.gethostname(), "/x").text()
    qemu.before_add = [theirs]  # added by another run just before our first add

    async def command(name: str, args: dict[str, object]) -> object:
        if name == "qom-get":  # that run ended in between: its mark is gone when we look
            qemu.objects.clear()
        return await FakeQemu.command(qemu, name, args)

    qemu.command = command  # type: ignore[method-assign]
    mark = await vmmark.take(qemu, "/run/vm/b.sock")
    assert mark.note is None
    assert qemu.commands == ["object-add", "qom-get", "object-add"]


async def test_release_leaves_another_run_s_mark() -> None:
    qemu = FakeQemu()
    mine = Mark(Holder.this_run("/run/vm/a.sock"))
    qemu.objects[MARK_ID] = Holder(1, 1, "elsewhere", "/y").text()
    await vmmark.release(qemu, mine)
    assert MARK_ID in qemu.objects
    del qemu.objects[MARK_ID]
    await vmmark.release(qemu, mine)  # no mark at all: nothing to do, no error


def test_the_holder_text_reads_back() -> None:
    holder = Holder(42, 7, "box", "/tmp/a b/qmp.sock")
    assert Holder.parse(holder.text()) == holder
    assert Holder.parse("pid=x started=1 host=h socket=/s") is None
    assert Holder.parse("") is None
