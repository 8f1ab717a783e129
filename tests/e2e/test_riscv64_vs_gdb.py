"""qmpprof's riscv64 kernel stacks against gdb-multiarch's, frame for frame, at MOMENTS random
moments of the riscv64 test guest (trixie's riscv64 6.12 on 2 vCPUs, no KASLR): gdb stops the
guest, qmpprof (a run loaded as the command loads it: ``--kernel`` the -dbg vmlinux alone)
samples it as it is over QMP, and each vCPU in kernel mode is judged by
``stackverdict.judge`` (tests/gdbmoments.py counts; the allowances of gdb's own limits capped).

Across the exception entry both walk on: where gdb's walk reaches ``handle_exception`` (not as
the leaf), the gdb script reads the ``struct pt_regs`` at that frame's sp through DWARF, and for
an exception taken in S-mode (its status's SPP bit) puts the registers saved there in the vCPU
and walks on from them, the interrupted code unwound by its own CFI at its own pc (the way
tests/aarch64gdb.py crosses arm64's entry). From user mode, gdb's kernel walk ends there, as
qmpprof's kernel frames do. A vCPU stopped inside the entry itself is compared down to there
(its interrupted pc may be only in sepc). Random moments seldom catch an exception taken in
the kernel (the workload runs mostly in user mode): IRQ_STOPS more moments stop on ``do_irq``
for an interrupt taken in S-mode, where both walks must cross into the interrupted code.

Only on the host's QEMU, as tests/e2e/test_riscv64_e2e.py: scripts/fetch-qemu's unstable tree
has no qemu-system-riscv64 yet.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path

import pytest
from gdbmoments import FunctionStarts, Tally, compare_moment, sampled, stopped_moment, summary
from guestvm import free_tcp_port
from linuxgdb import SCRIPT, KernelOracle
from riscv64vm import running_riscv64_guest, vmlinux_dbg
from stackverdict import KINDS, STOPS_EARLY

from qmpprof import session
from qmpprof.elf.image import ElfImage
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.guest import LinuxGuest
from qmpprof.transport.base import Reach

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

MOMENTS = 100
IRQ_STOPS = 10  # more moments, each at do_irq for an interrupt taken in the kernel
REQUIRED = 0.97  # of the stacks compared whole
# Each kind of allowance on at most this share of the moments' stacks; gdb stopping early
# (off the IRQ stack: call_on_irq_stack) as on arm64.
ALLOWANCE_CEILINGS = {**dict.fromkeys(KINDS, 0.02), STOPS_EARLY: 0.50}

_RISCV64 = r"""
QG_PT_REGS = None  # struct pt_regs *
# General registers by gdb's names, as pt_regs names its members; the pc is epc.
QG_REGISTERS = ("ra", "sp", "gp", "tp", "t0", "t1", "t2", "s0", "s1", "a0", "a1", "a2", "a3",
                "a4", "a5", "a6", "a7", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9", "s10",
                "s11", "t3", "t4", "t5", "t6", "pc")

def _interrupted(frame):
    global QG_PT_REGS
    if QG_PT_REGS is None:
        QG_PT_REGS = gdb.lookup_type("struct pt_regs").pointer()
    sp = int(frame.read_register("sp")) % 2**64
    regs = gdb.Value(sp).cast(QG_PT_REGS).dereference()
    if not int(regs["status"]) & 0x100:
        return None  # SPP clear: from user mode, the kernel stack ends here
    saved = {name: int(regs[name]) % 2**64 for name in QG_REGISTERS if name != "pc"}
    saved["pc"] = int(regs["epc"]) % 2**64
    return saved
"""


class Riscv64KernelOracle(KernelOracle):
    """gdb-multiarch on the riscv64 -dbg vmlinux, crossing ``handle_exception``."""

    program = "gdb-multiarch"
    script = SCRIPT + _RISCV64

    def entry(self, start: int, end: int) -> None:
        """The exception entry and exit code gdb crosses: [start, end)."""
        self.command(f'-interpreter-exec console "python _ENTRY = [{start:#x}, {end:#x}]"')

    def run_to_kernel_irq(self) -> None:
        """Let the stopped guest run on to ``do_irq``'s first instruction for an interrupt
        taken in S-mode (its ``pt_regs``, the argument in a0, with SPP set)."""
        condition = "((struct pt_regs *)$a0)->status & 0x100"
        self.command(f'-break-insert -t -c "{condition}" do_irq')
        lines = self.command("-exec-continue")
        if not any(line.startswith("*stopped") for line in lines):
            self._until(lambda line: line.startswith("*stopped"))


def entry_span(image: ElfImage) -> tuple[int, int]:
    """``handle_exception`` to the end of ``ret_from_exception`` (arch/riscv/kernel/entry.S
    lays them one after the other), by the vmlinux's symbols."""
    start = image.symbols.address_of("handle_exception")
    back = image.symbols.address_of("ret_from_exception")
    extent = None if back is None else image.symbols.extent(back)
    assert start is not None and extent is not None and start < extent[0]
    return start, extent[1]


async def compare(tmp_path: Path) -> Tally:
    rng = random.Random("qmpprof-riscv64-vs-gdb")
    tally = Tally()
    port = free_tcp_port()
    image = ElfImage.load(vmlinux_dbg())
    with running_riscv64_guest(tmp_path, gdb_port=port) as guest:
        oracle = Riscv64KernelOracle(port, vmlinux_dbg(), tmp_path / "qg.py", 0)
        try:
            oracle.entry(*entry_span(image))
            spec = session.RunSpec(
                reach=Reach(guest.qmp_socket, transport="qmp"), kernel=vmlinux_dbg()
            )
            linux = session.load(spec)
            assert isinstance(linux, LinuxGuest), linux
            run = await session.start(spec, guest=linux)
            starts = FunctionStarts(LinuxKernel.load(vmlinux_dbg()).symbols)
            try:
                for moment in range(MOMENTS + IRQ_STOPS):
                    if moment < MOMENTS:
                        seen = await stopped_moment(oracle, run, rng)
                    else:  # random moments seldom catch an interrupt taken in the kernel
                        oracle.stop_guest()
                        oracle.run_to_kernel_irq()
                        seen = await sampled(run)
                    # Processes: tests/e2e/test_riscv64_linux_e2e.py (tp or sscratch).
                    compare_moment(oracle, seen, f"moment {moment}", starts, tally, processes=False)
                    oracle.resume()
                    await linux.housekeep()
            finally:
                await run.transport.close()
        finally:
            oracle.close()
    return tally


def test_kernel_stacks_agree_with_gdb_across_the_exception_entry(tmp_path: Path) -> None:
    if shutil.which("gdb-multiarch") is None:
        pytest.fail("no gdb-multiarch on PATH (scripts/setup installs it)")
    started = time.monotonic()
    tally = asyncio.run(compare(tmp_path))
    print(f"\nriscv64 6.12: {tally.moments} moments in {time.monotonic() - started:.0f} s")
    print(summary(tally))
    assert tally.stacks >= MOMENTS // 2, tally.stacks
    # gdb walked on past the entry at the interrupts taken in the kernel (IRQ_STOPS), each
    # stack of such a vCPU compared whole or allowed.
    assert tally.crossed >= IRQ_STOPS, summary(tally)
    assert tally.frames >= 2 * tally.stacks, tally.frames  # not a vacuous prefix
    assert not tally.beyond(ALLOWANCE_CEILINGS), summary(tally)
    assert tally.agreeing >= REQUIRED, "\n".join(tally.differences)
