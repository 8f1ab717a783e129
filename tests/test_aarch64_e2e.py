"""End to end on qemu-system-aarch64: bookworm's arm64 6.1 and 6.12 booted with KASLR on, 2 vCPUs,
``-cpu max`` (pointer authentication signs the kernel's return addresses), and qmpprof
``--one-shot`` on it through the private gdbstub with ``--kernel`` the arm64 Image as shipped.
Every kernel frame must be named as the guest's own /proc/kallsyms names its address, the slide
must be the guest's, the walks must reach an exception entry, a new task's or the idle loop's
root (or be the one frame of a kernel entered from user mode), an exception taken in the
kernel must lead into the code it interrupted, and the guest must run on afterwards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from aarch64vm import ROOT, Aarch64Guest, TextSymbols, running_aarch64_guest
from guestvm import run_state

from qmpprof.linux.kernel import LinuxKernel

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

SHOTS = 6  # one-shots of both vCPUs
# Where a kernel stack begins: an exception taken from user code (el0t_64_sync, el0t_64_irq,
# ...), a kernel thread (ret_from_fork), the idle loop of the boot CPU and of the others.
ROOTS = ("ret_from_fork", "__primary_switched", "__secondary_switched")


@pytest.fixture(scope="module", params=["6.1", "6.12"])
def guest(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Aarch64Guest]:
    with running_aarch64_guest(tmp_path_factory.mktemp("aarch64"), request.param) as running:
        yield running


def one_shot(guest: Aarch64Guest, *extra: str) -> subprocess.CompletedProcess[str]:
    # python -m from the worktree's root: this checkout's qmpprof, whatever the venv installed.
    return subprocess.run(
        [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket),
         "--kernel", str(guest.kernel), "--one-shot", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_slide_is_the_guests(guest: Aarch64Guest) -> None:
    run = one_shot(guest, "-v")
    assert run.returncode == 0, run.stderr
    found = re.search(r"KASLR slide (0x[0-9a-f]+)", run.stderr)
    assert found is not None, run.stderr
    image = LinuxKernel.load(guest.kernel).symbols.address_of("_stext")
    running = guest.symbols.address_of("_stext")
    assert image is not None and running is not None
    assert int(found[1], 16) == running - image
    assert running != image  # KASLR moved it
    assert run_state(guest.qmp_socket) == "running"


def test_kernel_stacks_named_as_the_guests_kallsyms(guest: Aarch64Guest) -> None:
    stacks = []
    for _ in range(SHOTS):
        run = one_shot(guest, "--json", "-k")
        assert run.returncode == 0, run.stderr
        stacks += json.loads(run.stdout)
    assert run_state(guest.qmp_socket) == "running"
    kernel = [s for s in stacks if s["mode"] == "kernel"]
    # 2 vCPUs, one of the guest's three loops in user mode: about 60 % of samples in the kernel.
    assert len(kernel) >= SHOTS // 2, [s["mode"] for s in stacks]
    # Each sample names the task it runs (the per-CPU __entry_task: on 6.1 found from the EL0
    # handler's code, each vCPU's base its TPIDR_EL1), in user mode too, where the kernel is
    # unmapped (KPTI) and read through its linear map.
    nameless = [s for s in stacks if not (s.get("process") or {}).get("program")]
    assert not nameless, nameless
    text = TextSymbols(guest.symbols)
    for stack in kernel:
        frames = stack["frames"]
        for i, frame in enumerate(frames):
            addr = int(frame["address"], 16)
            # A caller's frame is named at its call: the return address - 1; the interrupted
            # code's under an exception taken in the kernel at its pc.
            at = addr if i == 0 or from_kernel_entry(frames[i - 1]) else addr - 1
            assert frame.get("symbol") in text.names_at(at), (frame, stack)
    # No walk ends at a return address it could not read: pointer-authentication codes are
    # stripped by the guest's TCR_EL1.
    assert not [s for s in kernel if s["stop"] == "bad-return"]
    ended = [s for s in kernel if s["stop"] == "end"]
    for stack in ended:
        root = stack["frames"][-1]
        # One frame: caught where the kernel was entered from user mode or leaves for it.
        alone = len(stack["frames"]) == 1 and from_user_entry(root)
        assert root["symbol"].startswith("el0t_64_") or root["symbol"] in ROOTS or alone, stack
    # An exception caught at its vector (a third of one-shot stops) is whole: entered from
    # user mode, one frame; from the kernel, the interrupted code's frames follow (ELR_EL1).
    entered = [s for s in kernel if from_user_entry(s["frames"][0])]
    assert all(s["stop"] == "end" for s in entered), entered
    assert not [s for s in kernel if from_kernel_entry(s["frames"][-1])]
    deep = [s for s in ended if len(s["frames"]) >= 5]
    assert len(deep) >= 2, [(s["stop"], len(s["frames"])) for s in kernel]


def from_kernel_entry(frame: dict[str, object]) -> bool:
    """A frame in a kernel-mode vector entry or handler (the exception came from the kernel)."""
    symbol, offset = frame.get("symbol"), frame.get("offset")
    if symbol == "vectors":
        return isinstance(offset, int) and 0x200 <= offset < 0x400
    return isinstance(symbol, str) and symbol.startswith("el1h_64_")


def from_user_entry(frame: dict[str, object]) -> bool:
    """A frame in a user-mode vector entry or handler, or on the way back to user mode."""
    symbol, offset = frame.get("symbol"), frame.get("offset")
    if symbol == "vectors":
        return isinstance(offset, int) and offset >= 0x400
    return isinstance(symbol, str) and (symbol.startswith("el0t_") or symbol == "ret_to_user")
