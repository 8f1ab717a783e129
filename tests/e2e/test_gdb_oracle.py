"""gdb, the oracle: Debian's gdb through QEMU's gdbstub unwinds the guest's kernel and user stacks
correctly in both builds, through the entry stubs' CFI into the interrupted user frames.

The team's unwinders are judged against ``guestvm.gdb_backtrace``; these tests pin down that the
oracle itself is right, against the stacks the guest's sources define (expected.json).
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from guestvm import (
    Guest,
    SymbolIndex,
    expected,
    free_tcp_port,
    gdb_stack,
    run_gdb,
    running_guest,
    user_breakpoint_condition,
)
from qemu.qmp import QMPClient
from qemumark import boots_qemu

EXPECTED = expected()
KERNEL_BOUNDARY = int(EXPECTED["kernel_boundary"], 16)
SPIN = EXPECTED["programs"]["spin"]
SYS = EXPECTED["programs"]["sys"]
KWORKER = EXPECTED["kernel_threads"]["kworker"]
USER_TAIL = ["main", EXPECTED["outermost"]["user"]]

pytestmark = pytest.mark.qemu


@pytest.fixture(scope="module", params=EXPECTED["variants"])
@boots_qemu
def guest(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, guest_build: None
) -> Iterator[Guest]:
    variant: str = request.param
    with running_guest(
        tmp_path_factory.mktemp("gdb"), variant, 2, gdb_port=free_tcp_port()
    ) as booted:
        yield booted


def test_syscall_path_unwinds_from_the_deepest_kernel_function_into_user(guest: Guest) -> None:
    stack = gdb_stack(guest, breakpoint=EXPECTED["syscall_path"][-1])
    assert stack.user_elf == guest.user_elf("sys")  # picked by the .text bytes in memory
    assert stack.names == SYS["stacks"][1]
    kernel = [pc >= KERNEL_BOUNDARY for pc, _ in stack.frames]
    assert kernel == [name in EXPECTED["syscall_path"] for name in stack.names]
    assert list(reversed(stack.names[:7])) == EXPECTED["syscall_path"]


def test_user_breakpoint_fires_only_in_the_chosen_program(guest: Guest) -> None:
    spin = guest.user_elf("spin")
    stack = gdb_stack(guest, spin, breakpoint="spin_hot", condition=user_breakpoint_condition(spin))
    assert stack.names == ["spin_hot", *USER_TAIL]
    assert all(pc < KERNEL_BOUNDARY for pc, _ in stack.frames)


def test_function_without_cfi_or_frame_unwinds(guest: Guest) -> None:
    spin = guest.user_elf("spin")
    stack = gdb_stack(guest, spin, breakpoint="spin_mix", condition=user_breakpoint_condition(spin))
    assert stack.names in SPIN["stacks"]


def test_kernel_thread_unwinds_through_the_frameless_leaf(guest: Guest) -> None:
    stack = gdb_stack(guest, None, breakpoint="checksum_leaf")
    assert stack.names in KWORKER["stacks"]
    assert all(pc >= KERNEL_BOUNDARY for pc, _ in stack.frames)


def test_timer_interrupt_in_user_mode_unwinds_into_the_interrupted_program(guest: Guest) -> None:
    stack = gdb_stack(guest, breakpoint="interrupt_dispatch", condition="r->cs == 0x23")
    assert stack.names[:2] == ["interrupt_dispatch", "isr_common"]
    user = stack.names[2:]
    assert stack.user_elf is not None
    program = stack.user_elf.stem
    valid = [s[i:] for s in EXPECTED["programs"][program]["stacks"] for i in range(len(s))]
    assert user[-2:] == USER_TAIL
    assert user in valid, stack.names
    assert all(pc < KERNEL_BOUNDARY for pc, _ in stack.frames[2:])


def test_timer_interrupt_in_kernel_mode_unwinds_the_interrupted_kernel_stack(
    guest: Guest,
) -> None:
    stack = gdb_stack(guest, breakpoint="interrupt_dispatch", condition="r->cs == 0x8")
    assert stack.names[:2] == ["interrupt_dispatch", "isr_common"]
    below = stack.names[2:]
    outermost = EXPECTED["outermost"]
    assert below[-1] in (outermost["user"], outermost["kernel_thread"], "kmain", "ap_main")
    assert "??" not in below, stack.names


@pytest.mark.parametrize("cpu", [0, 1])
async def test_any_moment_gives_a_complete_named_stack(guest: Guest, cpu: int) -> None:
    """Wherever the vCPU happens to be, gdb names every frame down to an outermost one."""
    client = QMPClient("test-gdb-oracle")
    await client.connect(str(guest.qmp_socket))
    try:
        await client.execute("cont")  # gdb left the guest stopped
        await asyncio.sleep(random.uniform(0.02, 0.1))
    finally:
        await client.disconnect()
    stack = gdb_stack(guest, cpu=cpu)
    assert "??" not in stack.names, stack.names
    outermost = EXPECTED["outermost"]
    assert stack.names[-1] in (outermost["user"], outermost["kernel_thread"], "kmain", "ap_main")
    if stack.user_elf is not None and stack.names[-1] == outermost["user"]:
        # (Not on a kernel thread's stack: stopped in schedule between loading the next
        # process's CR3 and switching stacks, gdb finds that process's ELF. Seen in CI.)
        assert stack.names[-2:] == USER_TAIL


_FP_WALK = (
    'python exec("import struct\\ninf = gdb.selected_inferior()\\n'
    "rbp = int(gdb.parse_and_eval('$rbp')) & (2**64 - 1)\\nout = []\\n"
    "while rbp and len(out) < 64:\\n"
    "    rbp, ret = struct.unpack('<QQ', bytes(inf.read_memory(rbp, 16)))\\n"
    "    out.append(ret)\\n"
    "print('FPWALK', ' '.join(hex(x) for x in out))\")"
)


def test_fp_build_frame_pointer_walk_crosses_the_interrupt_stub(tmp_path: Path) -> None:
    """In the fp build the stub links a frame [user rbp, user rip], so a walk of the rbp chain
    from the interrupt handler reaches the interrupted user function and its callers (minus
    the caller of a frameless leaf, the trap the fp unwinder has to handle)."""
    with running_guest(tmp_path, "fp", 1, gdb_port=free_tcp_port()) as fp:
        commands = ["break interrupt_dispatch if r->cs == 0x23", "continue", "delete"]
        output = run_gdb(fp, None, [*commands, _FP_WALK])
        oracle = gdb_stack(fp)  # same stop: gdb left the guest stopped
    walk = [int(x, 16) for x in re.search(r"FPWALK (.*)", output)[1].split()]  # type: ignore[index]
    assert oracle.user_elf is not None and oracle.names[:2] == ["interrupt_dispatch", "isr_common"]
    user = SymbolIndex(oracle.user_elf)
    names = [user.name(pc) for pc in walk]
    assert names[0] == oracle.names[2]  # the interrupted function, from the stub's frame
    assert names[-2:] == USER_TAIL
    assert walk[0] == oracle.frames[2][0]
