"""``--one-shot --off-cpu`` on the Linux test guest against the guest's own view of its tasks.

With ``qmpprof.offcpu`` on its command line the guest starts tasks blocked for an hour in known
places (a sleep, the reader of an empty FIFO, a futex waiter, a read of /proc/qmpprof_sleep in
uninterruptible sleep) and prints, as root, each one's /proc/PID/status State and
/proc/PID/stack (fixtures/linux-guest/init). Our off-CPU kernel stacks must equal those
function for function, on every kernel the tests boot (with KASLR), with one allowance:
/proc/PID/stack leaves out the scheduler's own frames (``stack_trace_save_tsk`` skips the
functions of ``.sched.text`` and ``.spinlock.text``, ``in_sched_functions``), so ours are
compared without the frames in those ranges (the kernel's ``__sched_text_start``/``_end`` and
``__lock_text_start``/``_end``), and how many were left out is counted. One boot per kernel
serves every check.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from guestvm import run_state, set_running
from linuxkernel import BOOTED, linux_dir
from linuxvm import ROOTFS, running_linux_guest

from qmpprof.linux.kernel import LinuxKernel

ROOT = Path(__file__).resolve().parents[2]
ORACLE = re.compile(
    r"^qmpprof-linux: offcpu task (\d+) begin\r?\nState:\s+(\S) \(([^)]*)\)\r?\n(.*?)"
    r"^qmpprof-linux: offcpu task end",
    re.M | re.S,
)
# The blocked tasks init starts: sleep, FIFO reader, the futex waiter's two threads,
# /proc/qmpprof_sleep.
TASKS = 5
SHARE = 0.95  # of those whose stacks must equal /proc's
DURATION = 5  # seconds of guest run time of each sampling run
FLAGS = ((), ("--off-cpu",))  # a sampling run without, then with --off-cpu
WEIGHT = 0.10  # how far a blocked task's samples may be from the ticks, at most
MAJOR = 0.10  # the on-CPU shares compared: of the processes with this much in either run


def oracle(console: str) -> dict[int, tuple[str, list[str]]]:
    """tid -> (state letter, the functions of its /proc/PID/task/TID/stack, leaf first)."""
    found = {}
    for pid, letter, _, stack in ORACLE.findall(console):
        names = re.findall(r"^\[<[0-9a-f]+>\] ([^+\s]+)\+", stack, re.M)
        found[int(pid)] = (letter, names)
    return found


def scheduler_ranges(kernel: LinuxKernel, text: int) -> list[tuple[int, int]]:
    """The text /proc/PID/stack leaves out, in the running kernel whose ``_text`` is at
    ``text`` (KASLR moved it)."""
    slide = text - (kernel.symbols.address_of("_text") or 0)
    ranges = []
    for section in ("sched", "lock"):
        start = kernel.address(f"__{section}_text_start", slide)
        end = kernel.address(f"__{section}_text_end", slide)
        assert start is not None and end is not None, section
        ranges.append((start, end))
    return ranges


@pytest.mark.qemu
@pytest.mark.linux
@pytest.mark.parametrize("series", BOOTED)
def test_off_cpu_stacks_and_states_are_the_guests_own(series: str, tmp_path: Path) -> None:
    vmlinuz = linux_dir(series) / "vmlinuz"
    with running_linux_guest(
        tmp_path, kaslr=True, kernel=vmlinuz, dump_kallsyms=False, append="qmpprof.offcpu"
    ) as guest:
        expected = oracle(guest.console_text())
        result = subprocess.run(
            [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket),
             "--kernel", str(vmlinuz), "--user-dir", str(ROOTFS), "--one-shot", "--off-cpu",
             "--json"],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert run_state(guest.qmp_socket) == "running"
        if series == BOOTED[0]:  # a paused guest is read as it stands, and stays paused
            set_running(guest.qmp_socket, False)
            paused = subprocess.run(
                [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket),
                 "--kernel", str(vmlinuz), "--one-shot", "--off-cpu"],
                capture_output=True, text=True, timeout=120, cwd=ROOT,
            )  # fmt: skip
            assert paused.returncode == 0, paused.stderr
            assert run_state(guest.qmp_socket) == "paused"
            assert "Tasks: " in paused.stdout and ": D (disk sleep)" in paused.stdout
            set_running(guest.qmp_socket, True)
        runs = {flag: sampling_run(guest.qmp_socket, vmlinuz, tmp_path, flag) for flag in FLAGS}
        assert run_state(guest.qmp_socket) == "running"
    assert len(expected) == TASKS, guest.console_text()
    skipped = scheduler_ranges(LinuxKernel.load(vmlinuz), guest.text_address)
    tasks = {t["process"]["tid"]: t for t in json.loads(result.stdout)["tasks"]}
    equal, left_out = 0, 0
    for tid, (letter, proc_stack) in expected.items():
        task = tasks[tid]
        assert task["state"] == letter, (tid, task["state"], letter)
        assert task["cpu"] is None and task["frames"], task
        kernel = [f for f in task["frames"] if int(f["address"], 16) >= 1 << 63]
        ours = [
            f["symbol"]
            for f in kernel
            if not any(lo <= int(f["address"], 16) < hi for lo, hi in skipped)
        ]
        left_out += len(kernel) - len(ours)
        equal += ours == proc_stack
        print(f"{series} tid {tid} {letter}: ours {ours}, /proc {proc_stack}")
    assert equal >= SHARE * len(expected), f"{equal} of {len(expected)} stacks equal"
    # __schedule and schedule (or schedule_timeout, do_nanosleep...) at least, in every stack.
    assert left_out >= 2 * len(expected), left_out
    # The user stacks beneath, from the pt_regs atop the kernel stacks: the futex waiter's two
    # threads (one process), walked down to the program's start (main tail-calls futex_threads:
    # no frame of its own) and to the thread's.
    waiter = [tasks[tid] for tid in expected if tasks[tid]["process"]["program"] == "qmpprof-work"]
    assert len(waiter) == 2 and len({t["process"]["pid"] for t in waiter}) == 1, waiter
    users = sorted(
        [f["symbol"] for f in thread["frames"] if int(f["address"], 16) < 1 << 63]
        for thread in waiter
    )
    assert all("futex_loop" in user for user in users), users
    assert ["futex_thread" in user for user in users] == [True, False], users
    assert users[1][users[1].index("futex_loop") + 1] == "futex_threads", users
    assert users[1][-2:] == ["__libc_start_main", "_start"], users
    # A task on a vCPU has no stack of its own here (the vCPU's sample is its stack).
    on_cpu = [t for t in tasks.values() if t["cpu"] is not None]
    assert len(on_cpu) <= 2 and all(t["frames"] is None for t in on_cpu), on_cpu
    # The rest of the guest's tasks were listed too: its kernel threads, init.
    assert len(tasks) > 20 and tasks[1]["process"]["program"] == "init", sorted(tasks)
    blocked = {tid: (tasks[tid]["process"]["pid"], letter) for tid, (letter, _) in expected.items()}
    check_sampling(runs, blocked)
    check_thread_lanes(tmp_path / "run1.speedscope.json", runs[("--off-cpu",)][1], expected)


def sampling_run(
    qmp_socket: Path, vmlinuz: Path, tmp_path: Path, flags: tuple[str, ...]
) -> tuple[Counter[tuple[str, ...]], int, str]:
    """A 5 s run: its folded stacks (root first), its ticks, its summary."""
    out = tmp_path / f"run{len(flags)}.folded"
    result = subprocess.run(
        [sys.executable, "-m", "qmpprof", "--qmp-socket", str(qmp_socket), "--kernel",
         str(vmlinuz), "--user-dir", str(ROOTFS), "--duration", str(DURATION), *flags,
         "-o", str(out), "-o", str(out.with_suffix(".speedscope.json"))],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ticks = re.search(r"(\d+) ticks", result.stderr)
    assert ticks is not None, result.stderr
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in out.read_text().splitlines():
        names, count = line.rsplit(" ", 1)
        stacks[tuple(names.split(";"))] += int(count)
    return stacks, int(ticks.group(1)), result.stderr


def check_sampling(
    runs: dict[tuple[str, ...], tuple[Counter[tuple[str, ...]], int, str]],
    blocked: dict[int, tuple[int | None, str]],
) -> None:
    """With --off-cpu, each blocked task weighs one sample a tick (within WEIGHT), under the
    ``[off-cpu: S]`` of its state; the processes on CPU with a major share (MAJOR) in a run
    with or without the flag are on CPU in the other."""
    (plain, _, plain_err), (mixed, ticks, mixed_err) = runs[()], runs[("--off-cpu",)]
    print(f"without --off-cpu:\n{plain_err}with --off-cpu:\n{mixed_err}")
    assert not any(names[1].startswith("[off-cpu: ") for names in plain if len(names) > 1)
    per_pid = Counter(pid for pid, _ in blocked.values())
    for tid, (pid, letter) in blocked.items():
        weight = sum(
            count
            for names, count in mixed.items()
            if names[0].endswith(f"(pid {pid})") and names[1:2] == (f"[off-cpu: {letter}]",)
        )
        assert abs(weight / per_pid[pid] - ticks) <= WEIGHT * ticks, (tid, weight, ticks)
    on_cpu = Counter({n: c for n, c in mixed.items() if not n[1:2] or "[off-cpu: " not in n[1]})
    assert sum(on_cpu.values()) > ticks / 2, on_cpu.most_common(5)
    # The flag neither drops nor invents on-CPU processes: each with a major share in one run
    # is on CPU in the other. How far two runs' shares move apart is the host's noise, not a
    # property of the flag (compared within 10 points, it failed once at load ~5).
    with_flag, without = shares(on_cpu), shares(plain)
    major = {root for run in (with_flag, without) for root, share in run.items() if share >= MAJOR}
    for root in sorted(major):
        share_with, share_without = with_flag.get(root, 0.0), without.get(root, 0.0)
        print(f"on-CPU share of {root}: {share_with:.3f} with --off-cpu, {share_without:.3f}")
        assert share_with > 0 and share_without > 0, (root, share_with, share_without)


def check_thread_lanes(path: Path, ticks: int, expected: dict[int, tuple[str, list[str]]]) -> None:
    """speedscope's lane of each blocked thread, "comm (pid/tid)", spans the run's wall time:
    a sample a tick (within WEIGHT), every one under its state's ``[off-cpu: S]``."""
    document = json.loads(path.read_text())
    names = [frame["name"] for frame in document["shared"]["frames"]]
    lanes = {
        int(found[1]): lane
        for lane in document["profiles"]
        if (found := re.fullmatch(r".* \(\d+/(\d+)\)", lane["name"]))
    }
    for tid, (letter, _) in expected.items():
        samples = lanes[tid]["samples"]
        assert abs(len(samples) - ticks) <= WEIGHT * ticks, (tid, len(samples), ticks)
        assert {names[s[1]] for s in samples} == {f"[off-cpu: {letter}]"}, tid


def shares(stacks: Counter[tuple[str, ...]]) -> dict[str, float]:
    """The share of each root (process, by name)."""
    roots: Counter[str] = Counter()
    for names, count in stacks.items():
        roots[re.sub(r" \(pid \d+\)", "", names[0])] += count
    total = sum(roots.values())
    return {root: count / total for root, count in roots.items()}
