"""qmpprof's stacks against gdb's on the i386 builds, frame for frame, under both QEMU binaries.

The method of test_unwind_vs_gdb: gdb (through tests/support/gdbi386.py's proxy, which shows it
an i386 target under qemu-system-x86_64 too) interrupts the guest at random moments; qmpprof
then samples the stopped guest over QMP (HMP's 32-bit ``EAX=…`` registers) and both stacks are
compared by function name, leaf first. There is no metadata page: gdb picks the current
process's user ELF by reading each program's ``.text`` under the current CR3, qmpprof tells
processes apart by CR3 (Cr3Identifier), from the very first moment (a process first caught
inside a system call is found by its .text too). The i386-pae build runs the same comparison
with CFI: its processes' CR3s differ only in bits 5..11 (expected.json), which qmpprof keeps.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from pathlib import Path

import pytest
from guestvm import expected, free_tcp_port, running_guest
from support.gdbi386 import I386GdbProxy
from test_unwind_vs_gdb import (
    FrameOracle,
    Mismatch,
    both_unknown_past_the_same_frames,
    listing,
    ours,
    without_cfi,
)

from qmpprof.arch.x86 import I386
from qmpprof.elf.image import ElfImage
from qmpprof.guest.cr3 import Cr3Identifier
from qmpprof.guest.programs import ProgramIndex
from qmpprof.sampler import Sampler, SamplerConfig
from qmpprof.transport.qmp import QmpTransport
from qmpprof.unwind.chain import Module, Unwinder
from qmpprof.unwind.steps import CfiStep

pytestmark = pytest.mark.qemu

EXPECTED = expected("i386")
STOPS = 200  # one vCPU: 200 stacks per binary
GARBAGE_CEILING = 0.02  # of the moments, at most: unknown code past the same frames in both
REQUIRED = 0.99

_SCRIPT = r"""
import hashlib, gdb
_qg = {"loaded": None}
_candidates = %(candidates)s
def qg_dump():
    try:
        _qg_dump()
    except Exception as err:
        print("QGFRAME error:%%s" %% str(err).replace(" ", "_"))
def _qg_dump():
    chosen = None
    inf = gdb.selected_inferior()
    for addr, size, digest, path in _candidates:
        try:
            if hashlib.sha256(bytes(inf.read_memory(addr, size))).hexdigest() == digest:
                chosen = path
                break
        except gdb.MemoryError:
            pass
    if chosen != _qg["loaded"]:
        if _qg["loaded"]:
            gdb.execute("remove-symbol-file -a %%#x" %% _candidates[0][0], to_string=True)
        if chosen:
            gdb.execute("add-symbol-file " + chosen, to_string=True)
        _qg["loaded"] = chosen
    qg_frames()
"""


class I386Oracle(FrameOracle):
    def __init__(self, kernel: Path, user_dir: Path, port: int, script: Path) -> None:
        candidates = []
        for elf in sorted(user_dir.glob("*.elf")):
            image = ElfImage.load(elf)
            text = image.text_bytes or b""
            digest = hashlib.sha256(text).hexdigest()
            candidates.append([image.text_addr, len(text), digest, str(elf)])
        super().__init__(kernel, port, script, _SCRIPT % {"candidates": json.dumps(candidates)})

    def stack(self) -> list[str]:
        return self.frames()


async def compare(
    qemu: str, tmp_path: Path, *, cfi: bool = True, variant: str = "i386"
) -> tuple[int, list[Mismatch], set[tuple[str, ...]]]:
    port = free_tcp_port()
    rng = random.Random(f"qmpprof-{variant}-{qemu}")
    agree = 0
    disagreements: list[Mismatch] = []
    seen: set[tuple[str, ...]] = set()
    with running_guest(tmp_path, variant, gdb_port=port, qemu=qemu) as guest:
        translate = qemu == "qemu-system-x86_64"
        with I386GdbProxy(port, translate=translate) as proxy:
            oracle = I386Oracle(guest.kernel_elf, guest.user_dir, proxy.port, tmp_path / "qg.py")
            transport = await QmpTransport.connect(guest.qmp_socket)
            kernel_elf, user_dir = guest.kernel_elf, guest.user_dir
            if not cfi:  # qmpprof's copies only: gdb keeps its CFI
                kernel_elf = without_cfi(kernel_elf, tmp_path / "nocfi")
                user_dir = tmp_path / "nocfi" / "user"
                for elf in sorted(guest.user_dir.glob("*.elf")):
                    without_cfi(elf, user_dir)
            kernel = Module.from_image(ElfImage.load(kernel_elf), kernel=True)
            assert isinstance(kernel.steps[0], CfiStep) == cfi
            tracker = Cr3Identifier([kernel], ProgramIndex.from_dir(user_dir), I386)
            unwinder = Unwinder(I386)
            try:
                for stop in range(1, STOPS + 1):
                    # Longer than the x86-64 test's pauses: on a loaded host the guest gets
                    # little CPU between two moments, and they must reach every phase of it.
                    time.sleep(rng.uniform(0.002, 0.06))
                    oracle.stop()
                    sampler = Sampler(transport, unwinder, tracker, SamplerConfig())
                    outcome = await sampler.run(one_shot=True)
                    assert not outcome.was_running
                    (sample,) = outcome.last
                    mine, theirs = ours(sample), oracle.stack()
                    seen.add(tuple(theirs))
                    if mine == theirs:
                        agree += 1
                    else:
                        disagreements.append((f"stop {stop}", theirs, mine))
                    oracle.resume()
            finally:
                oracle.close()
                await transport.close()
    print("\n".join(sorted(";".join(reversed(s)) for s in seen)))
    return agree, disagreements, seen


# (build, CFI): paging does not change how a stack is unwound, so the PAE build runs with CFI only.
BUILDS = [("i386", True), ("i386", False), ("i386-pae", True)]


@pytest.mark.parametrize(
    ("variant", "cfi"), BUILDS, ids=[f"{v}-{'cfi' if c else 'no-cfi'}" for v, c in BUILDS]
)
@pytest.mark.parametrize("qemu", EXPECTED["qemu"])
def test_i386_stacks_agree_with_gdb(qemu: str, variant: str, cfi: bool, tmp_path: Path) -> None:
    """``no-cfi``: every CFI section removed from qmpprof's copies, so frame pointers and
    prologue analysis (32-bit trap frames included) alone must find gdb's stacks."""
    agree, disagreements, seen = asyncio.run(compare(qemu, tmp_path, cfi=cfi, variant=variant))
    # Both walking unknown code past the same named frames, a different number of frames of it:
    # the timer's schedule caught between loading the next process's CR3 and switching stacks
    # (test_unwind_vs_gdb.both_unknown_past_the_same_frames): garbage to both, no verdict.
    garbage = [m for m in disagreements if both_unknown_past_the_same_frames(m[1], m[2])]
    disagreements = [m for m in disagreements if m not in garbage]
    print(f"set aside (unknown code past the same frames in both): {len(garbage)}")
    print(listing(garbage))
    total = agree + len(disagreements)
    what = variant if cfi else f"{variant} without CFI"
    share = f"{agree}/{total} ({agree / total:.1%})"
    print(f"\n{what} under {qemu}: qmpprof agrees with gdb on {share}")
    print(listing(disagreements))
    # Every moment compared one stack (its one vCPU): STOPS in all, the set-aside ones capped.
    assert total + len(garbage) == STOPS and len(garbage) <= GARBAGE_CEILING * STOPS
    assert agree / total >= REQUIRED, listing(disagreements)
    # The moments must reach user code, the system call path and the kernel thread.
    assert {"_start", "kthread_start"} <= {s[-1] for s in seen}, seen
    assert any("entry_syscall" in s for s in seen), seen
