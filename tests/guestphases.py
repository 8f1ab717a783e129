"""The bundled guest's own count of where its workload was: the timer interrupt counts, per task,
the ticks that find it in each phase (``phase_ticks``, fixtures/guest/common/workload.h), read
over QMP before and after a profile. A profile's split is compared with the difference, in the
same run, instead of with the shares the iteration counts promise (expected.json ``shares``).

Both are samples of the same time: the guest's ticks (one per slice of each task: 1250 in 20 s
on one vCPU with four tasks) and the profile's samples. Their difference is bounded by
``Z`` standard deviations of the difference of two binomial proportions, plus ``GLUE``."""

from __future__ import annotations

import asyncio
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elftools.elf.elffile import ELFFile
from guestvm import Guest, expected, memsave, section
from qemu.qmp import QMPClient

ROWS = 4  # PHASE_ROWS: a row per pid (spin 1 and 2, sys 3), kworker's row 0
PHASES = 3  # PHASES: 0 between the two parts, 1 the first, 2 the second
# A z of 4.5: a false alarm about once in 150,000 comparisons (some 50 per run of the files)
# were the samples independent; samples a few ms apart are not quite (a phase lasts a few ms
# of guest time), which the high z leaves room for.
Z = 4.5
# Time counted in a phase but not in its function, or the other way round: the stores around
# each call, the system call's gate and return (entry_syscall+0 held under 1 % of sys's samples,
# workload.h), the stages above compute_leaf.
GLUE = 0.01


def phase_ticks_address(kernel_elf: Path) -> int:
    symbol = expected()["phase_symbol"]
    with kernel_elf.open("rb") as f:
        found = section(ELFFile(f), ".symtab").get_symbol_by_name(symbol)
    assert found, f"{kernel_elf}: no {symbol}"
    return int(found[0]["st_value"])


def read_phase_ticks(guest: Guest) -> list[tuple[int, ...]]:
    """phase_ticks as the guest holds it now: a row of PHASES counts per row, over a QMP
    connection of its own (close it before a profiler takes the socket)."""

    async def read() -> bytes:
        client = QMPClient("phases")
        await client.connect(str(guest.qmp_socket))
        try:
            return await memsave(client, phase_ticks_address(guest.kernel_elf), ROWS * PHASES * 4)
        finally:
            await client.disconnect()

    raw = struct.unpack(f"<{ROWS * PHASES}I", asyncio.run(read()))
    return [raw[row * PHASES : (row + 1) * PHASES] for row in range(ROWS)]


@dataclass(frozen=True, slots=True)
class PhaseCount:
    """One task kind's ticks per phase between two reads (its instances added up)."""

    ticks: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.ticks)

    def share(self, phase: int) -> float:
        return self.ticks[phase] / self.total


def ticks_between(
    before: list[tuple[int, ...]], after: list[tuple[int, ...]], rows: list[int]
) -> PhaseCount:
    """The ticks counted in ``rows`` (pids; 0 for kworker) from ``before`` to ``after``."""
    return PhaseCount(tuple(sum(after[r][p] - before[r][p] for r in rows) for p in range(PHASES)))


def bound(guest_share: float, guest_ticks: int, samples: int) -> float:
    """How far a profile's share of ``samples`` may lie from the guest's of ``guest_ticks``:
    Z standard deviations of the difference of two binomial proportions of the same p, plus
    GLUE. p(1-p) is kept at least that of one sample in a hundred, so a share of 0 or 1 still
    has room for a stray sample."""
    p = min(max(guest_share, 0.01), 0.99)
    return Z * math.sqrt(p * (1 - p) * (1 / guest_ticks + 1 / samples)) + GLUE


def compare_split(
    label: str, spec: dict[str, Any], counts: Counter[str], guest: PhaseCount
) -> list[tuple[str, bool]]:
    """Each function of ``spec["phases"]``: its share of a profile's ``counts`` (samples
    containing it, of ``counts["__samples__"]``) against the share of the guest's ticks in its
    phase, within ``bound``; a line saying so, and whether it held."""
    samples = counts["__samples__"]
    found = []
    for function, phase in spec["phases"].items():
        measured = counts[function] / samples
        truth = guest.share(phase)
        room = bound(truth, guest.total, samples)
        found.append(
            (
                f"{label}.{function}: {measured:.3f} of {samples} samples vs the guest's"
                f" {truth:.3f} of {guest.total} ticks (bound {room:.3f})",
                abs(measured - truth) <= room,
            )
        )
    return found


def compare_tasks(
    samples: dict[int, int], before: list[tuple[int, ...]], after: list[tuple[int, ...]]
) -> list[tuple[str, bool]]:
    """Each task's share of a profile's ``samples`` (row -> samples: pid, kworker 0) against
    its share of the guest's ticks from ``before`` to ``after`` (all its phases), within
    ``bound``: the scheduler's split, as the guest counted it."""
    ticks = {row: sum(after[row]) - sum(before[row]) for row in range(ROWS)}
    all_ticks, all_samples = sum(ticks.values()), sum(samples.values())
    found = []
    for row in range(ROWS):
        measured = samples.get(row, 0) / all_samples
        truth = ticks[row] / all_ticks
        room = bound(truth, all_ticks, all_samples)
        found.append(
            (
                f"row {row}: {measured:.3f} of {all_samples} samples vs the guest's"
                f" {truth:.3f} of {all_ticks} ticks (bound {room:.3f})",
                abs(measured - truth) <= room,
            )
        )
    return found


def kernel_mode_ticks(before: list[tuple[int, ...]], after: list[tuple[int, ...]]) -> PhaseCount:
    """The guest's ticks from ``before`` to ``after`` as (user mode, kernel mode): a kernel
    thread's all kernel, a program's phase kernel where its functions run on the system call
    path (expected.json), the rest user."""
    shape = expected()
    path = set(shape["syscall_path"])
    user = kernel = 0
    for spec in shape["programs"].values():
        in_kernel = {p for f, p in spec["phases"].items() if f in path}
        for row in spec["phase_rows"]:
            for phase in range(PHASES):
                ticks = after[row][phase] - before[row][phase]
                kernel, user = (
                    (kernel + ticks, user) if phase in in_kernel else (kernel, user + ticks)
                )
    for spec in shape["kernel_threads"].values():
        kernel += sum(sum(after[row]) - sum(before[row]) for row in spec["phase_rows"])
    return PhaseCount((user, kernel))
