"""qmpprof serve: the ring, the flags, the pages and the metrics by hand (the daemon against real
QEMUs: tests/e2e/test_serve_guests.py)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from servepages import get, parse_prometheus
from test_output import hand_built_profile

from qmpprof.cli import main
from qmpprof.naming import Naming
from qmpprof.profile import Profile
from qmpprof.serve import metrics
from qmpprof.serve.endpoints import ServeState, listen, too_short
from qmpprof.serve.ring import Ring, merge
from qmpprof.serve.vm import Vm
from qmpprof.session import RunSpec
from qmpprof.stats import TRUSTED_SAMPLES
from qmpprof.transport import Reach

# ---- the ring -------------------------------------------------------------------------------


def push(ring: Ring, profile: Profile, at: float) -> None:
    ring.push(profile, at, at + 1.0, ticks=len(profile), errors=0, pauses=[0.002] * len(profile))


def test_a_stack_seen_in_several_seconds_is_stored_once_and_counted_in_each() -> None:
    ring = Ring(window=3)
    one = hand_built_profile()
    push(ring, one, 0.0)
    push(ring, one, 1.0)
    assert ring.stacks == len(one.stacks)
    merged = merge(ring.last(2), one.interval_ms, {"guest": "vm"})
    assert merged.named_counts(Naming()) == {
        names: 2 * count for names, count in one.named_counts(Naming()).items()
    }
    assert merged.cpus == one.cpus and merged.truncated == 2 * one.truncated
    assert merge(ring.last(1), 10.0, {}).named_counts(Naming()) == one.named_counts(Naming())


def test_tasks_off_cpu_keep_their_state_in_the_ring_and_are_counted_apart() -> None:
    from test_output_offcpu import OFF_CPU, ON_CPU, mixed_profile

    ring = Ring(window=2)
    push(ring, mixed_profile(), 0.0)
    (second,) = ring.last(1)
    assert (second.samples, second.off_cpu) == (2, 2)
    merged = merge(ring.last(1), 10.0, {})
    assert merged.named_counts(Naming()) == {ON_CPU: 2, OFF_CPU: 2}
    assert {s.state for s in merged.stacks} == {None, "S"}


def test_seconds_leave_the_ring_and_take_their_stacks_with_them() -> None:
    ring = Ring(window=2)
    push(ring, hand_built_profile(), 0.0)
    push(ring, Profile(), 1.0)
    assert ring.stacks == len(hand_built_profile().stacks)
    push(ring, Profile(), 2.0)
    assert ring.stacks == 0 and len(ring.seconds) == 2
    assert [s.start for s in ring.seconds] == [1.0, 2.0]
    assert len(merge(ring.last(10), 10.0, {})) == 0


# ---- flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give --qmp-socket"),
        (["--qmp-socket", "=/tmp/x.sock"], "not [NAME=]PATH"),
        (["--qmp-socket", "a="], "not [NAME=]PATH"),
        (["--qmp-socket", "a=/x", "--qmp-socket", "a=/y"], "two VMs named 'a'"),
        (["--qmp-socket", "/x", "--listen", "localhost"], "--listen: not HOST:PORT"),
        (["--qmp-socket", "/x", "--listen", "127.0.0.1:99999"], "--listen: not HOST:PORT"),
        (["--qmp-socket", "/x", "--window", "0"], "--window must be"),
        (
            ["--qmp-socket", "/x", "--interval", "-5"],
            "--interval must be from 0.1 to 5000 ms, not -5",
        ),
        (["--qmp-dir", "/nonexistent/qmpprof"], "--qmp-dir: not a directory"),
        (["--qmp-socket", "/x", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qmpprof: error: ") and message in err


def test_a_busy_port_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--qmp-socket", "/x", "--listen", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen on 127.0.0.1:" in err


def test_a_bad_elf_fails_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "kernel.elf"
    bad.write_bytes(b"not an ELF")
    code = main(["serve", "--qmp-socket", "/x", "--listen", ":0", "--kernel", str(bad)])
    assert code == 6 and capsys.readouterr().err.count("\n") == 1


def test_socket_names_default_to_the_file_stem() -> None:
    from qmpprof.cli.serve import parse

    config = parse(["--qmp-socket", "./run/vm1.sock", "--qmp-socket", "b=/tmp/a=b.sock"])
    assert config.sockets == (("vm1", Path("run/vm1.sock")), ("b", Path("/tmp/a=b.sock")))
    assert (config.host, config.port) == ("127.0.0.1", 6060)
    assert parse(["--qmp-socket", "/tmp/a=b.sock"]).sockets == (("a=b", Path("/tmp/a=b.sock")),)


# ---- pages, with VMs filled by hand ---------------------------------------------------------


def filled_vm(name: str, seconds: int = 3) -> Vm:
    vm = Vm(name, Reach(qmp_socket=Path(f"/tmp/{name}.sock")), RunSpec(), window=60)
    vm.state = "up"
    now = time.monotonic()
    for i in range(seconds):
        push(vm.ring, hand_built_profile(), now - seconds + i)
    vm.samples_total, vm.truncated_total, vm.errors_total = 24, 3, 1
    vm.pause_counts[2] = 5
    vm.pause_sum = 0.015
    return vm


def test_metrics_are_prometheus_text_with_every_family() -> None:
    vms = [filled_vm("a"), filled_vm('we"ird\\name')]
    vms[1].state = "down"
    parsed = parse_prometheus(metrics.scraper(lambda: vms)().decode())
    assert parsed["qmpprof_samples_total"][(("vm", "a"),)] == 24
    assert parsed["qmpprof_vm_up"] == {(("vm", "a"),): 1, (("vm", 'we\\"ird\\\\name'),): 0}
    assert parsed["qmpprof_pause_seconds_count"][(("vm", "a"),)] == 5
    assert parsed["qmpprof_pause_seconds_bucket"][(("le", "0.002"), ("vm", "a"))] == 0
    assert parsed["qmpprof_pause_seconds_bucket"][(("le", "0.005"), ("vm", "a"))] == 5
    assert parsed["qmpprof_offcpu_samples_total"][(("vm", "a"),)] == 0
    for family in ("errors_total", "truncated_total", "stopped_ratio", "pause_seconds_sum"):
        assert len(parsed[f"qmpprof_{family}"]) == 2


@contextmanager
def board_server(*vms: Vm) -> Iterator[str]:
    board = ServeState(window=60, naming=Naming(), vms=vms)
    server = listen("127.0.0.1", 0, board)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        board.closing.set()
        server.shutdown()
        server.server_close()


def test_endpoints_answer_and_refuse_in_one_line() -> None:
    with board_server(filled_vm("a"), filled_vm("b")) as base:
        status, kind, body = get(f"{base}/flamegraph.svg?vm=a&seconds=2")
        assert status == 200 and kind == "image/svg+xml" and b'data-total="16"' in body
        assert get(f"{base}/healthz")[::2] == (200, b"ok\n")
        status, _, page = get(f"{base}/")
        assert status == 200 and page.count(b'<tr class="vm">') == 2
        for path, code, text in [
            ("/flamegraph.svg", 400, "several VMs: add vm=NAME (a, b)"),
            ("/flamegraph.svg?vm=c", 404, "no VM named 'c'"),
            ("/flamegraph.svg?vm=a&seconds=61", 400, "seconds must be a whole number"),
            ("/debug/pprof/profile?vm=a&seconds=x", 400, "seconds must be a whole number"),
            ("/flamegraph.svg?vm=a&seconds=%C2%B2", 400, "seconds must be a whole number"),
            ("/nope", 404, "no such page: /nope"),
        ]:
            status, kind, body = get(base + path)
            assert (status, kind) == (code, "text/plain; charset=utf-8"), path
            assert body.decode().startswith(text) and body.count(b"\n") == 1
    with board_server(filled_vm("only")) as base:
        assert get(f"{base}/flamegraph.svg?seconds=1")[0] == 200


def test_a_window_too_short_for_the_rate_says_so_and_how_long_would_do() -> None:
    """16 samples in 2 s (the budget's rate): the SVG's facts say so, with the window that
    would hold enough at that rate; 400 are enough: nothing said."""
    with board_server(filled_vm("a")) as base:
        body = get(f"{base}/flamegraph.svg?vm=a&seconds=2")[2].decode()
    assert "only 16 samples in 2 s at the interval in force" in body
    assert f"ask for {math.ceil(2 * TRUSTED_SAMPLES / 16)} s or more" in body
    assert too_short(400, 2) is None
    assert too_short(0, 2) is not None and "longer window" in str(too_short(0, 2))


def test_a_bug_while_answering_is_a_one_line_500(monkeypatch: pytest.MonkeyPatch) -> None:
    from qmpprof.serve import endpoints

    def broken(*args: object) -> bytes:
        raise ValueError("no such luck")

    monkeypatch.setattr(endpoints, "render", broken)
    with board_server(filled_vm("a")) as base:
        assert get(f"{base}/flamegraph.svg")[::2] == (
            500,
            b"internal error: ValueError: no such luck\n",
        )
        assert get(f"{base}/healthz")[0] == 200


# ---- one VM's bookkeeping, over the fake transport ------------------------------------------


async def test_what_the_sampler_collected_moves_into_the_ring_and_its_counters_empty() -> None:
    from fakes import FakeTransport
    from test_sampler import kernel_cpu, make

    r0, pages = kernel_cpu(0)
    vm = Vm("fake", Reach(qmp_socket=Path("/tmp/fake.sock")), RunSpec(), window=2)
    for second in range(3):
        sampler = make(FakeTransport({0: r0}, pages), duration=0.05, interval=0.01)
        sampler.stats.errors["MemoryReadError: at 0x1000"] += 2  # as a failed read leaves it
        await sampler.run()
        vm.take(sampler, keep=True)
        assert len(sampler.profile) == 0 and len(sampler.stats.pauses) == 0
        assert not sampler.stats.errors
        assert vm.samples_total == 5 * (second + 1) and vm.errors_total == 2 * (second + 1)
    assert len(vm.ring.seconds) == 2 and vm.ring.stacks == 1
    assert sum(vm.pause_counts) == 15 and vm.problem == "MemoryReadError: at 0x1000"
    assert [s.ticks for s in vm.ring.seconds] == [5, 5]
