"""Linux's riscv64 platforms (linux/riscv64/): the Image told by its header, the slide read from
the ELF's type, the page tables the kernel's satp mode and linear map say (Sv39, Sv48; riscv's
entries: the PPN at bits 10..53, R/W/X marking a leaf), the current task in tp and, where tp
holds no kernel address, in sscratch."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fakes import FakeTransport

from qmpprof.arch.riscv64 import RISCV64 as RISCV64_ARCH
from qmpprof.arch.riscv64regs import riscv64_registers
from qmpprof.linux.platforms import boot_image, kernel_file
from qmpprof.linux.riscv64.kernelfile import RISCV64_FILE, is_riscv64_image
from qmpprof.linux.riscv64.running import RISCV64, RegisterTask
from qmpprof.linux.running.linearmap import LinearMap
from qmpprof.linux.running.platform import LoadedKernel
from qmpprof.linux.running.platforms import linux_platform
from qmpprof.linux.symbols import parse_export_table
from qmpprof.memory import Reader
from qmpprof.model import Registers
from qmpprof.pagecache import PageCache

TRIXIE_IMAGE = Path(__file__).parents[2] / "fixtures" / "build" / "linux-riscv64" / "vmlinuz"
VA_PA_OFFSET = 0xFF5F_FFFF_8000_0000  # PAGE_OFFSET (Sv57's) less where RAM starts (0x80000000)
SATP_MODE, KERNEL_MAP = 0xFFFF_FFFF_8140_A980, 0xFFFF_FFFF_8140_A938  # trixie 6.12's
V, R, W, X, U = 1, 2, 4, 8, 16
TASK = 0xFF60_0000_0123_4500  # a task_struct in the linear map
TLS = 0x3F_8A12_3780  # a user thread pointer


def pte(physical: int, flags: int) -> int:
    return (physical >> 12) << 10 | flags


@dataclass
class Memory:
    """Kernel memory: the two variables, and physical memory through the linear map."""

    words: dict[int, int] = field(default_factory=dict)
    physical: dict[int, bytearray] = field(default_factory=dict)
    requests: list[list[int]] = field(default_factory=list)  # the addresses of each read

    def put(self, phys: int, data: bytes) -> None:
        page = self.physical.setdefault(phys & ~0xFFF, bytearray(4096))
        page[phys & 0xFFF : (phys & 0xFFF) + len(data)] = data

    async def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        self.requests.append([addr for addr, _ in ranges])
        for addr, size in ranges:
            if addr in self.words:
                out.append(self.words[addr].to_bytes(8, "little")[:size])
                continue
            page = self.physical.get((addr - VA_PA_OFFSET) & ~0xFFF)
            at = addr & 0xFFF
            out.append(None if page is None else bytes(page[at : at + size]))
        return out


# struct kernel_mapping's members (6.12's BTF): their offsets
MAPPING = {"page_offset": 0x0, "virt_addr": 0x8, "va_pa_offset": 0x28, "size": 0x38}
MAPPING["va_kernel_pa_offset"] = 0x30


class Btf:
    def offset_of(self, path: str) -> int:
        struct_name, member = path.split(".")
        assert struct_name == "kernel_mapping"
        return MAPPING[member]


@dataclass
class Image:
    header: bytes

    def file_bytes(self, offset: int, size: int) -> bytes:
        return self.header[offset : offset + size]


@dataclass
class Kernel:
    image: Image
    btf: Btf = field(default_factory=Btf)

    def address(self, name: str, slide: int = 0) -> int | None:
        return {"satp_mode": SATP_MODE, "kernel_map": KERNEL_MAP}.get(name)


def vcpus(satp: int = 0) -> FakeTransport:
    """One vCPU in user mode whose satp is ``satp`` (0: bare, translating nothing)."""
    return FakeTransport({0: registers(True, TLS, {"satp": satp})})


def loaded(read: Reader, kernel: Kernel, transport: FakeTransport) -> LoadedKernel:
    """The fake kernel, unslid, as the platform reads it through ``read`` and ``transport``."""
    return LoadedKernel(read, kernel, 0, RISCV64_ARCH, transport)  # type: ignore[arg-type]


def elf_header(e_type: int) -> bytes:
    return b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HH", e_type, 243)


def test_the_registries_choose_riscv64_and_its_image_by_its_header() -> None:
    assert kernel_file("riscv64") is RISCV64_FILE
    assert linux_platform("riscv64") is RISCV64
    head = bytearray(64)  # Documentation/arch/riscv/boot-image-header.rst
    head[0:2] = b"MZ"  # the EFI stub's PE header begins the Image
    head[0x30:0x38] = b"RISCV\0\0\0"  # the deprecated magic
    head[0x38:0x3C] = b"RSC\x05"
    assert is_riscv64_image(bytes(head)) and boot_image(bytes(head)) is RISCV64_FILE
    with open(TRIXIE_IMAGE, "rb") as image:  # the PE/EFI Image Debian ships
        assert boot_image(image.read(64)) is RISCV64_FILE
    head[0x38:0x3C] = b"ARM\x64"
    assert not is_riscv64_image(bytes(head)) and boot_image(bytes(head)) is not RISCV64_FILE


async def test_the_slide_is_0_for_a_kernel_linked_at_fixed_addresses() -> None:
    kernel = Kernel(Image(elf_header(2)))  # ET_EXEC
    assert await RISCV64.slide(None, kernel, RISCV64_ARCH, None) == 0  # type: ignore[arg-type]


LINEAR = LinearMap(0xFF60_0000_0000_0000, 0xFFFF_FFFF_0000_0000, VA_PA_OFFSET)


@pytest.mark.parametrize(("mode", "levels"), [(8, 3), (9, 4), (10, 5)])
async def test_page_tables_have_the_levels_of_the_kernel_s_satp_mode(
    mode: int, levels: int
) -> None:
    memory = Memory({SATP_MODE: mode << 60})
    kernel = Kernel(Image(elf_header(2)))
    tables = await RISCV64.page_tables(loaded(memory.read, kernel, vcpus()), LINEAR)
    assert tables is not None
    bits = 12 + 9 * levels
    assert (tables.levels, tables.direct_map, tables.user_end) == (
        levels,
        VA_PA_OFFSET,
        1 << (bits - 1),
    )


async def test_an_sv39_walk_reads_riscv_entries_pages_and_megapages() -> None:
    memory = Memory({SATP_MODE: 8 << 60})
    kernel = Kernel(Image(b""))
    tables = await RISCV64.page_tables(loaded(memory.read, kernel, vcpus()), LINEAR)
    assert tables is not None
    root, middle, leaf = 0x8200_0000, 0x8200_1000, 0x8200_2000
    code = 0x2A_AAAA_B000  # a PIE's text under Sv39 (user space below 2^38)
    index = [(code >> (12 + 9 * level)) & 511 for level in (2, 1, 0)]
    memory.put(root + 8 * index[0], struct.pack("<Q", pte(middle, V)))
    memory.put(middle + 8 * index[1], struct.pack("<Q", pte(leaf, V)))
    memory.put(leaf + 8 * index[2], struct.pack("<Q", pte(0x8765_4000, V | R | X | U)))
    memory.put(0x8765_4000 + 0x10, b"\x13\x01\x01\xff")  # addi sp, sp, -16
    pgd = VA_PA_OFFSET + root
    assert await tables.physical(pgd, code + 0x10) == 0x8765_4010
    assert await tables.reader(pgd)([(code + 0x10, 4)]) == [b"\x13\x01\x01\xff"]
    # A 2 MiB megapage: a leaf (R/W set) in the middle level.
    data = 0x3F_C000_0000
    top, mid = (data >> 30) & 511, (data >> 21) & 511
    memory.put(root + 8 * top, struct.pack("<Q", pte(middle, V)))
    memory.put(middle + 8 * mid, struct.pack("<Q", pte(0x9000_0000, V | R | W | U)))
    tables.forget()  # its pages were read whole before
    assert await tables.physical(pgd, data + 0x1_2345) == 0x9001_2345
    # Not valid: nothing.
    memory.put(leaf + 8 * index[2], struct.pack("<Q", pte(0x8765_4000, R | X | U)))
    tables.forget()
    assert await tables.physical(pgd, code) is None


def registers(user: bool, tp: int, special: dict[str, int] | None = None) -> Registers:
    pc = 0x2A_AAAA_B010 if user else 0xFFFF_FFFF_80A8_1240
    gprs = {2: 0xFF20_0000_0000_3F00, 4: tp, 8: 0, RISCV64_ARCH.pc: pc}
    return riscv64_registers(0, gprs, special or {})


async def test_the_current_task_is_tp_in_the_kernel_and_sscratch_else() -> None:
    current = RegisterTask(RISCV64_ARCH, lambda: 0.0, 1.0)
    memory = Memory()
    kernel = registers(False, TASK)
    assert current.wants(kernel) == ()
    assert await current.pointer(memory.read, kernel, PageCache()) == TASK
    # User mode: tp is the user's thread pointer; the entry code keeps the task in sscratch.
    user = registers(True, TLS)
    assert current.wants(user) == ("sscratch",)
    assert await current.pointer(memory.read, user, PageCache()) is None
    user = registers(True, TLS, {"sscratch": TASK})
    assert current.wants(user) == ()
    assert await current.pointer(memory.read, user, PageCache()) == TASK
    # handle_exception entered from the kernel: tp swapped with sscratch's 0 for a moment.
    entering = registers(False, 0, {"sscratch": TASK})
    assert await current.pointer(memory.read, entering, PageCache()) == TASK
    assert await current.running(memory.read) == {}


def test_exports_of_absolute_entries_are_read_and_relative_ones_not_taken_for_them() -> None:
    """riscv64 has no CONFIG_HAVE_ARCH_PREL32_RELOCATIONS: ``struct kernel_symbol`` is three
    u64 (value, name, namespace), addresses; x86_64's three s32 must not read as such."""
    strings, strings_addr, table_addr = b"\0init_task\0schedule\0", 0xFFFF_FFFF_814A_7274, 0x1000
    entries = struct.pack("<3Q", 0xFFFF_FFFF_8140_0000, strings_addr + 1, 0)
    entries += struct.pack("<3Q", 0xFFFF_FFFF_8080_0000, strings_addr + 11, 0)
    found = parse_export_table(entries, table_addr, strings, strings_addr)
    assert found == [("init_task", 0xFFFF_FFFF_8140_0000), ("schedule", 0xFFFF_FFFF_8080_0000)]
    relative_addr = strings_addr - 0x100
    relative = struct.pack("<3i", -0x40, 0x100 + 1 - 4, 0)
    relative += struct.pack("<3i", -0x80, 0x100 + 11 - 16, 0)
    assert parse_export_table(relative, relative_addr, strings, strings_addr) == [
        ("init_task", relative_addr - 0x40),
        ("schedule", relative_addr + 12 - 0x80),
    ]


async def test_the_linear_map_and_the_image_are_placed_from_kernel_map() -> None:
    page_offset, virt_addr, phys_addr = 0xFF60_0000_0000_0000, 0xFFFF_FFFF_8000_0000, 0x8020_0000
    fields = {
        "page_offset": page_offset,
        "va_pa_offset": VA_PA_OFFSET,
        "virt_addr": virt_addr,
        "size": 0x1C0_0000,
        "va_kernel_pa_offset": virt_addr - phys_addr,
    }
    memory = Memory({KERNEL_MAP + MAPPING[name]: value for name, value in fields.items()})
    linear = await RISCV64.linear_map(loaded(memory.read, Kernel(Image(b"")), vcpus()))
    assert linear is not None
    task = 0xFF60_0000_0391_2AC0  # a task_struct (slab memory)
    assert linear.physical(task, 8) == task - VA_PA_OFFSET
    assert linear.physical(virt_addr + 0x1000, 8) == phys_addr + 0x1000  # the image's data
    assert linear.physical(0xFF20_0000_0000_3F00, 8) is None  # a vmalloc'd stack: not there
    del memory.words[KERNEL_MAP + MAPPING["size"]]
    assert await RISCV64.linear_map(loaded(memory.read, Kernel(Image(b"")), vcpus())) is None


async def test_the_page_tables_come_with_the_linear_map_read_once() -> None:
    """Walked in the linear map: none before it is found (attach met no vCPU in the kernel, whose
    variables a vCPU in user mode does not read), then from the map measured late; ``kernel_map``
    read once, ``satp_mode`` after it."""
    fields = {"page_offset": 0xFF60_0000_0000_0000, "va_pa_offset": VA_PA_OFFSET, "size": 1 << 26}
    fields |= {"virt_addr": 0xFFFF_FFFF_8000_0000, "va_kernel_pa_offset": 0x7FFF_FFFF_0000_0000}
    words = {KERNEL_MAP + MAPPING[name]: value for name, value in fields.items()}
    memory = Memory({**words, SATP_MODE: 9 << 60})
    kernel = Kernel(Image(elf_header(2)))
    assert await RISCV64.page_tables(loaded(memory.read, kernel, vcpus()), None) is None
    assert memory.requests == []
    linear = await RISCV64.linear_map(loaded(memory.read, kernel, vcpus()))
    assert linear is not None
    tables = await RISCV64.page_tables(loaded(memory.read, kernel, vcpus()), linear)
    assert tables is not None and (tables.levels, tables.direct_map) == (4, VA_PA_OFFSET)
    first, second = memory.requests  # two requests: the map, then the mode
    assert sorted(first) == sorted(words) and second == [SATP_MODE]


async def test_with_no_vcpu_in_the_kernel_its_variables_are_read_through_a_vcpu_s_satp() -> None:
    """Every vCPU in user mode (a guest paused so): QEMU reads no supervisor page through them,
    so the map and the mode are read through the root satp gives, walked physically (Sv39: a
    gigapage table, then the image's 2 MiB megapage)."""
    kernel = Kernel(Image(elf_header(2)))
    fields = {"page_offset": 0xFF60_0000_0000_0000, "va_pa_offset": VA_PA_OFFSET, "size": 1 << 26}
    root, middle, image = 0x8100_0000, 0x8100_1000, 0x8160_0000  # physical
    # The image's megapage at 0xffffffff81400000 holds kernel_map and satp_mode.
    image_offset = 0xFFFF_FFFF_8140_0000 - image
    fields |= {"virt_addr": 0xFFFF_FFFF_8000_0000, "va_kernel_pa_offset": image_offset}
    pages: dict[int, bytearray] = {}

    def put(phys: int, value: int) -> None:
        page = pages.setdefault(phys & ~0xFFF, bytearray(4096))
        page[phys & 0xFFF : (phys & 0xFFF) + 8] = value.to_bytes(8, "little")

    put(root + 8 * ((KERNEL_MAP >> 30) & 511), pte(middle, V))
    put(middle + 8 * ((KERNEL_MAP >> 21) & 511), pte(image, V | R | W))  # a megapage
    for name, value in fields.items():
        put(image + (KERNEL_MAP + MAPPING[name]) % (1 << 21), value)
    put(image + SATP_MODE % (1 << 21), 8 << 60)
    transport = vcpus(8 << 60 | 0x1234 << 44 | root >> 12)  # Sv39, ASID 0x1234
    transport.physical = {at: bytes(page) for at, page in pages.items()}
    unreadable = Memory()  # user mode: no kernel address reads through the vCPU
    linear = await RISCV64.linear_map(loaded(unreadable.read, kernel, transport))
    assert linear is not None and linear.offset == VA_PA_OFFSET
    assert linear.physical(KERNEL_MAP, 8) == image + KERNEL_MAP % (1 << 21)
    tables = await RISCV64.page_tables(loaded(unreadable.read, kernel, transport), linear)
    assert tables is not None and tables.levels == 3
    # A bare satp (firmware before the kernel's MMU) translates nothing: nothing is read.
    bare = vcpus()
    bare.physical = transport.physical
    assert await RISCV64.linear_map(loaded(unreadable.read, kernel, bare)) is None
    assert "read_physical" not in bare.calls
