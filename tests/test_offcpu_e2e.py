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

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from guestvm import run_state
from linuxkernel import BOOTED, linux_dir
from linuxvm import ROOTFS, running_linux_guest

from qmpprof.linux.kernel import LinuxKernel
from qmpprof.transport.qmp import QmpTransport

ROOT = Path(__file__).resolve().parent.parent
ORACLE = re.compile(
    r"^qmpprof-linux: offcpu task (\d+) begin\r?\nState:\s+(\S) \(([^)]*)\)\r?\n(.*?)"
    r"^qmpprof-linux: offcpu task end",
    re.M | re.S,
)
# The blocked tasks init starts: sleep, FIFO reader, the futex waiter's two threads,
# /proc/qmpprof_sleep.
TASKS = 5
SHARE = 0.95  # of those whose stacks must equal /proc's


def oracle(console: str) -> dict[int, tuple[str, list[str]]]:
    """tid -> (state letter, the functions of its /proc/PID/task/TID/stack, leaf first)."""
    found = {}
    for pid, letter, _, stack in ORACLE.findall(console):
        names = re.findall(r"^\[<[0-9a-f]+>\] ([^+\s]+)\+", stack, re.M)
        found[int(pid)] = (letter, names)
    return found


async def pause(qmp_socket: Path) -> None:
    transport = await QmpTransport.connect(qmp_socket)
    try:
        await transport.stop()
    finally:
        await transport.close()


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
            asyncio.run(pause(guest.qmp_socket))
            paused = subprocess.run(
                [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket),
                 "--kernel", str(vmlinuz), "--one-shot", "--off-cpu"],
                capture_output=True, text=True, timeout=120, cwd=ROOT,
            )  # fmt: skip
            assert paused.returncode == 0, paused.stderr
            assert run_state(guest.qmp_socket) == "paused"
            assert "Tasks: " in paused.stdout and ": D (disk sleep)" in paused.stdout
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
