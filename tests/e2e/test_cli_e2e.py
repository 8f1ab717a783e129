"""End to end: the qmpprof command against the bundled guest in a real QEMU (tests/guestvm.py).

Sample count of a 5 s run and each task's share of it against the guest's own count,
SIGINT/SIGTERM mid-run, a paused guest, QEMU killed mid-run, --kernel-only/--user-only, two
vCPUs. Every QEMU is killed by running_guest or witnessvm.vm (a witness QMP socket that counts
qmpprof's pauses before a test stops a run).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from guestphases import bound, compare_tasks, kernel_mode_ticks, read_phase_ticks
from guestvm import Guest, expected, free_tcp_port, running_guest
from qemus import every_qemu
from qmpevents import wait_stops
from witnessvm import Vm, vm

from qmpprof.cli import main
from qmpprof.output import folded
from qmpprof.transport.qmp import QmpTransport

pytestmark = [pytest.mark.qemu, every_qemu]

KERNEL_BOUNDARY = int(expected()["kernel_boundary"], 16)
PAUSES = 5  # qmpprof's pauses of the guest seen before a test stops the run: it has samples
RUN_TIMEOUT = 120.0  # a loaded 2-core host runs TCG guests many times slower than usual


async def _qmp(guest: Guest, what: str) -> object:
    transport = await QmpTransport.connect(guest.qmp_socket)
    try:
        if what == "status":
            return await transport.status()
        await transport.stop()
        return None
    finally:
        await transport.close()


def qmp(guest: Guest, what: str) -> object:
    return asyncio.run(_qmp(guest, what))


def cli_args(guest: Guest, *extra: str) -> list[str]:
    return ["--qmp-socket", str(guest.qmp_socket), "--kernel", str(guest.kernel_elf), *extra]


def spawn(guest: Guest, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "qmpprof", *cli_args(guest, *extra)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_sampling(proc: subprocess.Popen[str], machine: Vm) -> None:
    """Until qmpprof says it samples (under load, starting takes a while), then until it has
    paused the guest PAUSES times (the witness socket's STOP events)."""
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert line.startswith("qmpprof: sampling "), line + proc.communicate()[1]
    wait_stops(machine.more[0], PAUSES, RUN_TIMEOUT)
    assert proc.poll() is None, proc.communicate()


def assert_collected_written(err: str, out: Path) -> None:
    """The output holds every sample the run says it collected, and it collected some."""
    collected = re.search(r"^Samples: (\d+) ", err, re.MULTILINE)
    assert collected is not None and int(collected[1]) > 0, err
    assert sum(c for _, c in folded.parse(out.read_text())) == int(collected[1])


def profile_5s(guest: Guest, out: Path, *extra: str) -> tuple[int, list[tuple[str, bool]], str]:
    """Profile 5 s at 10 ms: (samples written, each task's share of them against its share
    of the guest's own ticks over the run (guestphases.compare_tasks), stderr)."""
    args = [*cli_args(guest, *extra), "--interval", "10", "--duration", "5", "-v"]
    before = read_phase_ticks(guest)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main([*args, "-o", str(out)])
    after = read_phase_ticks(guest)
    assert qmp(guest, "status") == "running"
    assert rc == 0, err.getvalue()
    per_task: Counter[int] = Counter()
    for frames, count in folded.parse(out.read_text()):
        pid = re.search(r"\(pid (\d+)\)$", frames[0])
        per_task[int(pid[1]) if pid else 0] += count  # "kernel": kworker, row 0
    return sum(per_task.values()), compare_tasks(per_task, before, after), err.getvalue()


def test_five_seconds_at_10ms_keeps_samples_and_the_guest_running(tmp_path: Path) -> None:
    with running_guest(tmp_path) as guest:
        samples, tasks, err = profile_5s(guest, tmp_path / "out.folded")
    print(err, *(line for line, _ in tasks), sep="\n", file=sys.stderr)
    assert samples >= 450  # 90 % of 5 s / 10 ms
    # The guest went on working while sampled: on its one vCPU the samples found each of its
    # four tasks as often as its own timer did. How much of its speed it kept is scripts/bench's
    # to measure (qmp_overhead_100hz against floor_overhead_100hz).
    assert all(held for _, held in tasks), "\n".join(line for line, _ in tasks)


def test_gdbstub_transport_keeps_samples_and_the_guest_running(tmp_path: Path) -> None:
    port = free_tcp_port()
    address = f"127.0.0.1:{port}"
    with running_guest(tmp_path, gdb_port=port) as guest:
        samples, tasks, err = profile_5s(guest, tmp_path / "gdb.folded", "--gdb", address)
    print(err, *(line for line, _ in tasks), sep="\n", file=sys.stderr)
    assert samples >= 450
    # The guest went on working while sampled (the transport resumed it every tick), each task
    # as often as the guest's timer found it. How much of its speed it kept is scripts/bench's
    # (qmpprof_gdb_overhead_100hz against gdbstub_overhead_100hz).
    assert all(held for _, held in tasks), "\n".join(line for line, _ in tasks)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_run_writes_output_and_guest_runs(tmp_path: Path, signum: int) -> None:
    out = tmp_path / "sig.folded"
    with vm(tmp_path, smp=1, more_sockets=1) as machine:
        proc = spawn(machine.guest, "--duration", "60", "-o", str(out))
        wait_sampling(proc, machine)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert qmp(machine.guest, "status") == "running"
        assert machine.advances()
    assert "Traceback" not in err
    assert_collected_written(err, out)
    assert f"Wrote {out}" in err


def test_paused_guest_stays_paused_and_one_shot_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_guest(tmp_path) as guest:
        qmp(guest, "stop")
        args = cli_args(guest, "--user-dir", str(guest.user_dir), "--show-addresses")
        rc = main([*args, "--duration", "2"])
        assert qmp(guest, "status") == "paused"
    captured = capsys.readouterr()
    assert rc == 0
    assert "the guest is paused: took one sample without resuming it" in captured.err
    assert captured.out.startswith("vCPU 0: ")
    outermost = expected()["outermost"]
    assert outermost["user"] in captured.out or outermost["kernel_thread"] in captured.out
    # The outputs' naming rule: _[k] on kernel code (told by its address), the module once.
    listed = re.findall(r"^  #\d+ +(0x[0-9a-f]+) (.*)$", captured.out, re.M)
    assert listed
    for address, name in listed:
        assert (int(address, 16) >= KERNEL_BOUNDARY) == ("_[k]" in name), (address, name)
        assert not re.search(r"(\[[^]]+\]).* \(\1\)", name), name


@pytest.mark.parametrize(("transport", "channel"), [("qmp", "QMP"), ("auto", "gdbstub")])
def test_qemu_killed_mid_run_keeps_partial_output(
    tmp_path: Path, transport: str, channel: str
) -> None:
    out = tmp_path / "partial.folded"
    with vm(tmp_path, smp=1, more_sockets=1) as machine:
        proc = spawn(machine.guest, "--transport", transport, "--duration", "60", "-o", str(out))
        wait_sampling(proc, machine)
        machine.guest.process.kill()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 4
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"qmpprof: error: QEMU closed the {channel} connection; the samples collected so far"
        f" are in {out}"
    )
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert f"`{err.splitlines()[-1].replace(str(out), 'FILE')}`" in readme  # as documented
    assert_collected_written(err, out)


@pytest.mark.parametrize("flag", ["--kernel-only", "--user-only"])
def test_mode_filters_keep_only_what_was_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    out = tmp_path / "mode.folded"
    with running_guest(tmp_path) as guest:
        args = cli_args(guest, "--user-dir", str(guest.user_dir), "--duration", "3")
        before = read_phase_ticks(guest)
        rc = main([*args, flag, "-o", str(out)])
        modes = kernel_mode_ticks(before, read_phase_ticks(guest))
    err = capsys.readouterr().err
    assert rc == 0
    stacks = folded.parse(out.read_text())
    roots = {names[0] for names, _ in stacks}
    kept = sum(c for _, c in stacks)
    counts = re.search(r"Samples: (\d+)  Errors: (\d+)  Truncated: \d+  Filtered: (\d+)", err)
    assert counts is not None
    assert int(counts.group(1)) == kept and int(counts.group(2)) == 0
    # The share kept is the share of the guest's ticks in the mode asked, as its timer found.
    mode = 1 if flag == "--kernel-only" else 0
    share, samples = kept / (kept + int(counts.group(3))), kept + int(counts.group(3))
    room = bound(modes.share(mode), modes.total, samples)
    print(f"{flag}: kept {share:.3f} of {samples}, the guest {modes.share(mode):.3f} of"
          f" {modes.total} ticks (bound {room:.3f})")  # fmt: skip
    assert abs(share - modes.share(mode)) <= room
    processes = {f"{p} (pid {pid})" for p in ("spin", "sys") for pid in (1, 2, 3)}
    if flag == "--kernel-only":
        # Kernel samples only, user frames cut; in a process's context its label is the root.
        # Every frame is kernel code, marked _[k] under the kernel root as under a process's.
        assert "kernel" in roots and roots <= {"kernel", *processes}
        frames = [n for names, _ in stacks for n in names[1:] if n != "[truncated]"]
        assert frames and all(n.endswith("_[k]") for n in frames), frames
    else:
        assert roots and roots <= processes
        assert not any(names[-1].endswith("_[k]") for names, _ in stacks)


def test_two_vcpus_are_both_sampled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_guest(tmp_path, smp=2) as guest:
        assert main(cli_args(guest, "--one-shot", "--json")) == 0
        one_shot = json.loads(capsys.readouterr().out)
        rc = main(cli_args(guest, "--duration", "0.5", "--cpus", "0-1"))
    err = capsys.readouterr().err
    assert rc == 0
    assert [s["cpu"] for s in one_shot] == [0, 1]
    assert all(s["frames"] and s["frames"][0]["address"] for s in one_shot)
    # Each frame says whether it is kernel code (the upper half here), inlined (only --lines
    # makes such frames) or put back from a tail jump (only a Linux guest's code gives them).
    frames = [f for s in one_shot for f in s["frames"]]
    assert all(f["kernel"] == (int(f["address"], 16) >= KERNEL_BOUNDARY) for f in frames), frames
    assert not any(f["inlined"] or f["tail_call"] for f in frames), frames
    ticks = re.search(r"(\d+) ticks", err)
    samples = re.search(r"Samples: (\d+)", err)
    assert ticks is not None and samples is not None
    assert int(samples.group(1)) == 2 * int(ticks.group(1)) == 100


def test_gdb_transport(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_tcp_port()
    out, lanes = tmp_path / "gdb.folded", tmp_path / "gdb.speedscope.json"
    with running_guest(tmp_path, gdb_port=port) as guest:
        # The QMP socket tells the run state before the stub attaches (which stops the guest).
        args = cli_args(guest, "--gdb", f"127.0.0.1:{port}")
        rc = main([*args, "--duration", "1", "-o", str(out), "-o", str(lanes), "-v"])
        assert qmp(guest, "status") == "running"
    err = capsys.readouterr().err
    print(err, file=sys.stderr)
    assert rc == 0
    assert "did not say" not in err
    stacks = folded.parse(out.read_text())
    assert sum(c for _, c in stacks) == 100
    assert any("kworker_main_[k]" in names for names, _ in stacks)
    # speedscope: the vCPU's lane is the run's samples, 10 ms of guest run time each, and its
    # axis that clock too (the wall time the run took, pauses in it, is longer: no empty tail).
    (lane,) = json.loads(lanes.read_text())["profiles"]
    assert len(lane["samples"]) == 100 and lane["weights"] == [10.0] * 100
    assert (lane["startValue"], lane["endValue"]) == (0, 1000.0)


def test_gdb_transport_alone_says_what_it_took_the_run_state_to_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With only --gdb, the stub is the one witness: 7.2's says that attaching stopped the
    running guest (resumed, profiled, left running), 8.1 and later stay silent (a note says the
    guest was taken as paused, and it is left paused)."""
    port = free_tcp_port()
    with running_guest(tmp_path, gdb_port=port) as guest:
        args = ["--gdb", f"127.0.0.1:{port}", "--kernel", str(guest.kernel_elf)]
        rc = main([*args, "--qmp-socket", str(tmp_path / "none"), "--duration", "1"])
        status = qmp(guest, "status")
    err = capsys.readouterr().err
    assert rc == 0, err
    silent = "the gdbstub did not say whether attaching stopped the guest" in err
    assert status == ("paused" if silent else "running"), err
    assert ("took one sample without resuming it" in err) == silent, err


def test_forced_hmp_memory_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hmp.folded"
    with running_guest(tmp_path) as guest:
        rc = main(cli_args(guest, "--memory", "hmp", "--duration", "0.5", "-o", str(out)))
    assert rc == 0, capsys.readouterr().err
    stacks = folded.parse(out.read_text())
    assert sum(c for _, c in stacks) == 50
    assert any(
        names[-1] == "checksum_leaf_[k]" and "kworker_main_[k]" in names for names, _ in stacks
    )


def test_lines_name_frames_by_file_and_line(tmp_path: Path) -> None:
    out = tmp_path / "lines.folded"
    with running_guest(tmp_path) as guest:
        args = [*cli_args(guest, "--user-dir", str(guest.user_dir), "--lines", "--duration", "1")]
        assert main([*args, "-o", str(out)]) == 0
    stacks = [frames for frames, _ in folded.parse(out.read_text())]
    named = re.compile(r"^\w+ \([\w.]+\.[cS]:\d+\)(_\[[ik]\])*$")
    frames = [f for stack in stacks for f in stack[1:] if not f.startswith("[")]
    assert frames and all(named.match(f) for f in frames), frames
    assert any(f.startswith("compute_leaf (syscall.c:") for f in frames)
    assert any(f.startswith("spin_hot (spin.c:") for f in frames)


def test_an_overhead_budget_holds_on_the_real_guest(tmp_path: Path) -> None:
    out = tmp_path / "budget.folded"
    with running_guest(tmp_path, smp=2) as guest:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(cli_args(guest, "--interval", "1", "--duration", "1",
                               "--max-overhead", "20", "-o", str(out)))  # fmt: skip
        assert qmp(guest, "status") == "running"
    assert rc == 0, err.getvalue()
    # The budget was in force and reported; the share stopped it held to is scripts/bench's
    # to measure (--serve-soak: each VM's share of the wall time stopped).
    found = re.search(r"stood stopped ([\d.]+)% of the wall time \(budget 20.0%\)", err.getvalue())
    assert found is not None, err.getvalue()
    assert sum(c for _, c in folded.parse(out.read_text())) > 0
