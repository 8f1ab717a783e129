"""Kernel memory read physically through the linear map when a vCPU's translation hides it:
the offset measured as QEMU translates the vCPUs' slots through a vCPU in kernel mode, and
the view that sends linear addresses to physical memory and the rest through the vCPU; measured
by housekeeping when attach could not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

import pytest
from fakes import FakeTransport, regs

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.riscv64 import RISCV64
from qmpprof.errors import TransportError
from qmpprof.linux.aarch64.running import AARCH64 as AARCH64_LINUX
from qmpprof.linux.running.current import CurrentTask
from qmpprof.linux.running.identify import LINEAR_TRIES, LinuxIdentifier
from qmpprof.linux.running.linearmap import LinearMap, find_linear_map, linear_reader
from qmpprof.linux.running.platform import LoadedKernel
from qmpprof.transport.hmp import parse_gva2gpa

START, END = 0xFFFF_0000_0000_0000, 0xFFFF_8000_0000_0000
OFFSET = 0xFFFE_FFFF_C000_0000  # the linear address of physical 0x4000_0000 is START
KERNEL_PC, USER_PC = 0xFFFF_FFFF_8100_0000, 0x40_1000


def transport(*, user: tuple[bool, ...] = (False, True)) -> FakeTransport:
    fake = FakeTransport(
        {cpu: regs(cpu, USER_PC if u else KERNEL_PC) for cpu, u in enumerate(user)}
    )
    fake.linear_offset = OFFSET
    return fake


def test_the_offset_comes_from_a_kernel_mode_vcpu() -> None:
    fake = transport()
    slots = [START + 0x1000, START + 0x9000]
    found = asyncio.run(find_linear_map(fake, slots, START, END))
    assert found == LinearMap(START, END, OFFSET)
    assert "translate:1" not in fake.calls  # the user-mode vCPU is not asked


def test_no_vcpu_in_kernel_mode_means_no_offset() -> None:
    fake = transport(user=(True, True))
    assert asyncio.run(find_linear_map(fake, [START + 0x1000], START, END)) is None


def test_slots_outside_the_region_are_not_measured() -> None:
    assert asyncio.run(find_linear_map(transport(), [END + 0x1000], START, END)) is None


def test_the_view_reads_linear_addresses_physically() -> None:
    fake = transport()
    fake.physical[0x4000_2000] = bytes(range(256)) * 16
    fake.pages[0x40_1000] = b"\x11" * 4096
    read = linear_reader(fake, LinearMap(START, END, OFFSET), 1)
    found = asyncio.run(read([(START + 0x2010, 4), (0x40_1000, 2), (START + 0x5000, 8)]))
    assert found[0] == bytes([16, 17, 18, 19])
    assert found[1] == b"\x11\x11"  # a user address: through the vCPU
    assert found[2] is None  # not in RAM


@pytest.mark.parametrize(
    ("reply", "address"), [("gpa: 0x40210a80\r\n", 0x4021_0A80), ("Unmapped\r\n", None)]
)
def test_gva2gpa_replies(reply: str, address: int | None) -> None:
    assert parse_gva2gpa(reply) == address


def test_an_odd_gva2gpa_reply_is_an_error() -> None:
    with pytest.raises(TransportError, match="gva2gpa"):
        parse_gva2gpa("unknown command: 'gva2gpa'")


def test_the_image_is_measured_at_its_start_and_read_at_its_own_offset() -> None:
    fake = transport()
    image = (0xFFFF_8000_0800_0000, 0xFFFF_8000_0A01_0000, 0xFFFF_8000_0801_0000)
    found = asyncio.run(find_linear_map(fake, [START + 0x1000], START, image[0], image))
    assert found is not None and found.image == (*image[:2], OFFSET)  # the fake's one offset
    assert found.physical(image[0] + 0x10, 8) == image[0] + 0x10 - OFFSET
    assert found.physical(image[1] - 4, 8) is None  # past the image's end
    assert "translate:0" in fake.calls
    assert found.physical(START + 0x20, 8) == START + 0x20 - OFFSET


class Measure:
    """A late measurement of the linear map that finds it at its ``at``-th call (None: never)."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.calls = 0

    async def __call__(self) -> LinearMap | None:
        self.calls += 1
        return LinearMap(START, END, OFFSET) if self.calls == self.at else None


async def test_the_linear_map_attach_could_not_measure_is_measured_between_samples() -> None:
    """Measured by housekeeping (the guest running), never in a pause: not before a vCPU's
    per-CPU base is known, then once a call until found, at most LINEAR_TRIES times."""
    current = cast(CurrentTask, SimpleNamespace(bases={}, per_cpu=True))
    measure = Measure(3)
    identifier = LinuxIdentifier([], AARCH64, current=current, find_linear=measure)
    await identifier.housekeep()
    assert measure.calls == 0 and identifier.linear is None  # no base known to measure by
    current.bases[0] = 0xFFFF_0000_1234_0000
    for _ in range(5):
        await identifier.housekeep()
    assert measure.calls == 3 and identifier.linear == LinearMap(START, END, OFFSET)
    never = Measure(None)
    identifier = LinuxIdentifier([], AARCH64, current=current, find_linear=never)
    for _ in range(LINEAR_TRIES + 3):
        await identifier.housekeep()
    assert never.calls == LINEAR_TRIES and identifier.linear is None


async def test_a_task_in_registers_needs_no_base_to_measure_the_map_by() -> None:
    """riscv64: the current task in a register, the map in a kernel variable that attach could
    not read (no vCPU in the kernel then): measured at the next housekeeping."""
    current = cast(CurrentTask, SimpleNamespace(bases={}, per_cpu=False))
    measure = Measure(1)
    identifier = LinuxIdentifier([], RISCV64, current=current, find_linear=measure)
    await identifier.housekeep()
    assert measure.calls == 1 and identifier.linear == LinearMap(START, END, OFFSET)


def test_with_every_vcpu_in_user_mode_the_kernels_own_tables_measure_it() -> None:
    # Issue 35: a guest paused with each vCPU at EL0 translates no kernel address; the walk
    # the platform gives (arm64's TTBR1_EL1 tables) does, at once.
    fake = transport(user=(True, True))
    asked: list[int] = []

    async def walk(addr: int) -> int | None:
        asked.append(addr)
        return addr - OFFSET

    slots = [START + 0x1000, START + 0x9000]
    assert asyncio.run(find_linear_map(fake, slots, START, END, walk=walk)) == LinearMap(
        START, END, OFFSET
    )
    assert asked == slots and not any(c.startswith("translate") for c in fake.calls)

    async def nowhere(addr: int) -> int | None:
        asked.append(addr)
        return None  # KPTI: TTBR1_EL1 holds the trampoline's tables at EL0

    asked.clear()
    assert asyncio.run(find_linear_map(fake, slots, START, END, tries=3, walk=nowhere)) is None
    assert asked == slots * 3  # every pass tried again: a vCPU may enter the kernel meanwhile


def test_arm64_walks_the_kernels_tables_at_ttbr1_physically() -> None:
    fake = transport(user=(True, True))
    va, page = START + 0x12_3456_7000 + 0x9A8, 0x4123_4000
    tables = [0x4000_0000, 0x4000_1000, 0x4000_2000, 0x4000_3000]  # levels 4..1
    for level, (table, below) in enumerate(zip(tables, [*tables[1:], page], strict=True)):
        index = (va >> (39 - 9 * level)) & 511
        data = bytearray(4096)
        data[8 * index : 8 * index + 8] = (below | 0b11).to_bytes(8, "little")  # table, page
        fake.physical[table] = bytes(data)
    ttbr1 = 0x0042 << 48 | tables[0] | 1  # an ASID and CnP around the table's address
    loaded = SimpleNamespace(registers={"TCR_EL1": 16 | 16 << 16, "TTBR1_EL1": ttbr1},
                             control=fake, address=lambda name: va)  # fmt: skip
    walk = AARCH64_LINUX.kernel_walk(cast(LoadedKernel, loaded))
    assert walk is not None
    assert asyncio.run(walk(va)) == page + 0x9A8
    assert asyncio.run(walk(va + 0x1000)) is None  # not mapped
    assert AARCH64_LINUX.kernel_walk(cast(LoadedKernel, SimpleNamespace(registers={}))) is None
    # KPTI at EL0: TTBR1_EL1 holds the trampoline's tables, which map no kernel text; the
    # kernel's lie where the trampoline's code moves it (two pages above, as on 6.1).
    code = b"".join(
        w.to_bytes(4, "little") for w in (0xD538203E, 0x91400BDE, 0x924FFBDE, 0xD518203E)
    )
    fake.physical[0x3FFF_E000] = bytes(4096)
    trampoline = SimpleNamespace(
        registers={"TCR_EL1": 16 | 16 << 16, "TTBR1_EL1": 0x0043 << 48 | 0x3FFF_E000},
        control=fake, address=lambda name: va,
        kernel=SimpleNamespace(image=SimpleNamespace(text_bytes=code)),
    )  # fmt: skip
    assert asyncio.run(AARCH64_LINUX.kernel_root(cast(LoadedKernel, trampoline))) == tables[0]
    walk = AARCH64_LINUX.kernel_walk(cast(LoadedKernel, trampoline))
    assert walk is not None and asyncio.run(walk(va)) == page + 0x9A8
    trampoline.kernel.image.text_bytes = b""  # no trampoline in the code: not found
    assert asyncio.run(AARCH64_LINUX.kernel_root(cast(LoadedKernel, trampoline))) is None
