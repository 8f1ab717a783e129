"""The guest identifiers over a fake guest: the Emerald metadata page, .text matching, caching,
pid reuse, no page; CR3 alone; the Linux identifier's races with a guest that starts processes
all the time (a task_struct reused, an exec between two reads, an mm at a reused address)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from fakes import FakeTransport, read_each, x86
from guestvm import BUILD_ROOT
from test_guest_linux import APP_LEADER, KWORKER, PER_CPU_OFFSET, RECHECK, paused
from test_guest_linux import guest as linux_guest
from test_guest_linux import make as make_linux

from qmpprof.arch.riscv64 import RISCV64
from qmpprof.arch.riscv64regs import riscv64_registers
from qmpprof.arch.x86 import X86_64
from qmpprof.elf.image import ElfImage
from qmpprof.errors import MemoryReadError, UsageError
from qmpprof.guest.base import Identity
from qmpprof.guest.cr3 import Cr3Identifier
from qmpprof.guest.emerald import EmeraldIdentifier
from qmpprof.guest.metadata import METADATA_ADDR
from qmpprof.guest.programs import ProgramIndex
from qmpprof.linux.btf import Btf
from qmpprof.linux.riscv64.running import RegisterTask
from qmpprof.linux.running import spaces as spaces_module
from qmpprof.linux.running.tasks import PF_KTHREAD, TaskLayout
from qmpprof.linux.running.vma import VM_EXEC, Vma, VmaLayout
from qmpprof.memory import Reader
from qmpprof.model import Mapping, Registers
from qmpprof.pagecache import PAGE, PageCache, page_of
from qmpprof.unwind.space import Module
from qmpprof.unwind.steps import CfiStep

KERNEL_CR3 = 0x1000


class PagedGuest:
    """Guest memory per address space (CR3); counts reads."""

    def __init__(self) -> None:
        self.spaces: dict[int, dict[int, bytes]] = {}
        self.cr3_of: dict[int, int] = {}
        self.reads = 0

    def put(self, cr3: int, addr: int, data: bytes) -> None:
        pages = self.spaces.setdefault(cr3, {})
        for pos in range(page_of(addr), addr + len(data), PAGE):
            page = bytearray(pages.get(pos, bytes(PAGE)))
            lo, hi = max(pos, addr), min(pos + PAGE, addr + len(data))
            page[lo - pos : hi - pos] = data[lo - addr : hi - addr]
            pages[pos] = bytes(page)

    async def read(self, cpu: int, addr: int, size: int) -> bytes:
        self.reads += 1
        pages = self.spaces.get(self.cr3_of[cpu], {})
        out = b""
        for pos in range(page_of(addr), addr + size, PAGE):
            if pos not in pages:
                raise MemoryReadError(addr, size)
            out += pages[pos]
        return out[addr - page_of(addr) :][:size]

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        return await read_each(self.read, cpu, ranges)

    @property
    def control(self) -> None:
        return None

    # The rest of GuestTransport is not used by the tracker.
    async def is_running(self) -> bool:
        return True

    async def stop(self) -> None: ...

    async def cont(self) -> None: ...

    async def cpus(self) -> list[int]:
        return sorted(self.cr3_of)

    async def registers(self, cpu: int) -> Registers:
        raise AssertionError("not used")

    async def close(self) -> None: ...


def metadata_page(pid: int, image: ElfImage, text_addr: int | None = None) -> bytes:
    eh = image.section_addr(".eh_frame") or 0
    eh_data = image.section(".eh_frame") or b""
    lo, hi = image.load_range
    text = image.text_addr if text_addr is None else text_addr
    words = (pid, lo, hi - lo, 0x40, eh, len(eh_data), text, image.text_size)
    return struct.pack("<8Q", *words)


def regs(cpu: int, cr3: int, cpl: int = 3) -> Registers:
    return x86(cpu, 0x401000, 0x7FF000, cpl=cpl, cr3=cr3)


@pytest.fixture
def images(guest_build: None) -> dict[str, ElfImage]:
    user = BUILD_ROOT / "cfi" / "user"
    return {p.stem: ElfImage.load(p) for p in sorted(user.glob("*.elf"))}


def start(guest: PagedGuest, cpu: int, cr3: int, pid: int, image: ElfImage, text: bytes) -> None:
    guest.cr3_of[cpu] = cr3
    guest.put(cr3, METADATA_ADDR, metadata_page(pid, image))
    guest.put(cr3, image.text_addr, text)
    eh = image.section(".eh_frame")
    if eh:
        guest.put(cr3, image.section_addr(".eh_frame") or 0, eh)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


KERNEL = Module(Mapping("kernel", 1 << 63, (1 << 64) - 1, kernel=True))


def tracker(
    images: dict[str, ElfImage], clock: Clock | None = None, *, fallback: bool = True
) -> EmeraldIdentifier:
    programs = ProgramIndex(list(images.values()))
    return EmeraldIdentifier([KERNEL], programs, X86_64, clock=clock or Clock(), fallback=fallback)


async def test_two_instances_of_one_program_both_get_symbols(
    images: dict[str, ElfImage],
) -> None:
    guest = PagedGuest()
    spin = images["spin"]
    start(guest, 0, 0xA000, 1, spin, spin.text_bytes)
    start(guest, 1, 0xB000, 2, spin, spin.text_bytes)
    t = tracker(images)
    first = await t.identify(guest, regs(0, 0xA000), PageCache())
    second = await t.identify(guest, regs(1, 0xB000), PageCache())
    assert first.process is not None and second.process is not None
    assert (first.process.label, second.process.label) == ("spin (pid 1)", "spin (pid 2)")
    for ident in (first, second):
        user = ident.space.find(spin.text_addr + 1)
        assert user is not None and user.symbols is not None and user.name == "spin"


async def test_a_known_process_is_not_read_again(images: dict[str, ElfImage]) -> None:
    guest = PagedGuest()
    start(guest, 0, 0xA000, 1, images["spin"], images["spin"].text_bytes)
    clock = Clock()
    t = tracker(images, clock)
    await t.identify(guest, regs(0, 0xA000), PageCache())
    reads = guest.reads
    # Within RECHECK of the last reading: no read at all, not even the metadata page.
    clock.now += t.recheck / 2
    assert t.reads_for(regs(0, 0xA000)) == ()
    again = await t.identify(guest, regs(0, 0xA000, cpl=0), PageCache())
    assert guest.reads == reads
    assert again.process is not None and again.process.program == "spin"
    # Later the page is read again (pipelined by the sampler with the stack), but not .text.
    clock.now += t.recheck
    assert t.reads_for(regs(0, 0xA000)) == ((METADATA_ADDR, 64),)
    await t.identify(guest, regs(0, 0xA000), PageCache())
    assert guest.reads == reads + 1


async def test_reused_pid_running_another_program_is_identified_again(
    images: dict[str, ElfImage],
) -> None:
    guest = PagedGuest()
    start(guest, 0, 0xA000, 1, images["spin"], images["spin"].text_bytes)
    clock = Clock()
    t = tracker(images, clock)
    assert (await t.identify(guest, regs(0, 0xA000), PageCache())).process.program == "spin"  # type: ignore[union-attr]
    guest.spaces.clear()
    start(guest, 0, 0xA000, 1, images["sys"], images["sys"].text_bytes)
    clock.now += t.recheck + 0.01
    ident = await t.identify(guest, regs(0, 0xA000), PageCache())
    assert ident.process is not None and ident.process.label == "sys (pid 1)"


async def test_unknown_program_is_unwound_with_eh_frame_from_guest_memory(
    images: dict[str, ElfImage],
) -> None:
    guest = PagedGuest()
    sys_image = images["sys"]
    patched = bytes(b ^ 0xFF for b in sys_image.text_bytes)  # no ELF has this .text
    start(guest, 0, 0xC000, 9, sys_image, patched)
    ident = await tracker(images).identify(guest, regs(0, 0xC000), PageCache())
    assert ident.process is not None and ident.process.label == "[unknown] (pid 9)"
    user = ident.space.find(sys_image.text_addr)
    assert user is not None and user.symbols is None
    cfi = user.steps[0]
    assert isinstance(cfi, CfiStep)
    assert cfi.table.row_for(sys_image.symbols.address_of("main") or 0) is not None


async def test_kernel_thread_without_a_page_belongs_to_the_kernel(
    images: dict[str, ElfImage],
) -> None:
    guest = PagedGuest()
    guest.cr3_of[0] = KERNEL_CR3
    ident = await tracker(images).identify(guest, regs(0, KERNEL_CR3, cpl=0), PageCache())
    assert ident.process is None


async def test_without_metadata_spaces_are_told_apart_by_cr3_and_text(
    images: dict[str, ElfImage],
) -> None:
    guest = PagedGuest()
    spin = images["spin"]
    guest.cr3_of[0] = 0xA000
    guest.put(0xA000, spin.text_addr, spin.text_bytes)
    guest.cr3_of[1] = 0xB000
    guest.put(0xB000, spin.text_addr, bytes(len(spin.text_bytes)))
    t = tracker(images)
    known = await t.identify(guest, regs(0, 0xA000), PageCache())
    unknown = await t.identify(guest, regs(1, 0xB000), PageCache())
    assert known.process is not None and known.process.label == "spin (cr3=0xa000)"
    assert unknown.process is not None and unknown.process.label == "cr3=0xb000"
    assert t.metadata_addr is None  # user code ran without a page: stop asking for it
    # The same address space in kernel mode (a system call) stays attributed to its process.
    in_kernel = await t.identify(guest, regs(0, 0xA000, cpl=0), PageCache())
    assert in_kernel.process == known.process


async def test_emerald_without_fallback_keeps_asking_for_the_page(
    images: dict[str, ElfImage],
) -> None:
    guest = PagedGuest()
    guest.cr3_of[0] = 0xB000
    guest.put(0xB000, 0x401000, bytes(16))
    t = tracker(images, fallback=False)
    ident = await t.identify(guest, regs(0, 0xB000), PageCache())
    assert ident.process is not None and ident.process.label == "cr3=0xb000"
    assert t.metadata_addr == METADATA_ADDR  # --os emerald: a later process may have a page
    spin = images["spin"]
    start(guest, 1, 0xA000, 7, spin, spin.text_bytes)
    later = await t.identify(guest, regs(1, 0xA000), PageCache())
    assert later.process is not None and later.process.label == "spin (pid 7)"


async def test_cr3_identifier_never_reads_a_metadata_page(images: dict[str, ElfImage]) -> None:
    guest = PagedGuest()
    spin = images["spin"]
    start(guest, 0, 0xA000, 1, spin, spin.text_bytes)
    t = Cr3Identifier([KERNEL], ProgramIndex(list(images.values())), X86_64)
    assert t.reads_for(regs(0, 0xA000)) == ()
    ident = await t.identify(guest, regs(0, 0xA000), PageCache())
    assert ident.process is not None and ident.process.label == "spin (cr3=0xa000)"
    guest.cr3_of[1] = 0x5000  # a kernel page directory: no program's .text there
    assert (await t.identify(guest, regs(1, 0x5000, cpl=0), PageCache())).process is None
    assert (await t.identify(guest, regs(1, 0x5000, cpl=0), PageCache())).process is None
    assert guest.reads == 1 + len(images)  # the kernel's CR3 is searched once


async def test_cr3_identifier_names_a_process_first_seen_in_the_kernel(
    images: dict[str, ElfImage],
) -> None:
    """Caught inside a system call before it was ever seen in user mode: still the process."""
    guest = PagedGuest()
    spin = images["spin"]
    start(guest, 0, 0xA000, 1, spin, spin.text_bytes)
    t = Cr3Identifier([KERNEL], ProgramIndex(list(images.values())), X86_64)
    ident = await t.identify(guest, regs(0, 0xA000, cpl=0), PageCache())
    assert ident.process is not None and ident.process.label == "spin (cr3=0xa000)"


def test_program_index_ignores_files_that_are_not_elf(tmp_path: Path) -> None:
    (tmp_path / "README").write_text("not a program")
    assert len(ProgramIndex.from_dir(tmp_path)) == 0


def test_a_missing_user_dir_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a directory"):
        ProgramIndex.from_dir(tmp_path / "missing")


# The Linux identifier's identity races, each as the churn test met it on 6.1, on fake guest
# memory laid out as Debian's 6.12 (tests/unit/test_guest_linux.py's fakes).

MM_A, MM_B = 0xFFFF_8880_0500_0000, 0xFFFF_8880_0700_0000  # two mm_structs' addresses
SHELL_CODE, XZ_CODE = 0x40_0000, 0x50_0000  # where each program's code is mapped
STACK = 0xFFFF_C900_0001_0000  # the task's kernel stack
KERNEL_PC = 0xFFFF_FFFF_8100_0010  # in KERNEL (test_guest_linux.py)


@pytest.fixture(scope="module")
def layout(linux_vmlinux: ElfImage) -> TaskLayout:
    btf = Btf.from_image(linux_vmlinux)
    assert btf is not None
    return TaskLayout.from_btf(btf)


class Churn:
    """One task_struct on vCPU 0 (a kworker on vCPU 1), the programs it runs and each mm's
    mappings: what a guest that starts processes all the time does to it between samples."""

    def __init__(self, layout: TaskLayout, monkeypatch: pytest.MonkeyPatch) -> None:
        self.layout = layout
        self.memory = linux_guest(layout, (APP_LEADER, KWORKER))
        self.memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
        self.memory.put(APP_LEADER + layout.stack, struct.pack("<Q", STACK))
        self.mapped: dict[int, list[Vma]] = {}  # mm -> its executable mappings
        self.transport = FakeTransport({}, {})

        async def vmas_of(read: Reader, mm: int, _layout: object, _end: int) -> list[Vma]:
            return list(self.mapped.get(mm, []))

        monkeypatch.setattr(spaces_module, "read_exec_vmas", vmas_of)
        vmas = cast(VmaLayout, SimpleNamespace(pgd=0x58, map_count=0x60))
        self.identifier = make_linux(layout, PER_CPU_OFFSET, vmas=vmas)

    def run(self, pid: int, program: str, mm: int, code: int) -> None:
        """The task at APP_LEADER is ``pid`` running ``program`` in ``mm``, its code at ``code``."""
        self.memory.task(self.layout, APP_LEADER, pid, pid, program, 0, APP_LEADER)
        self.memory.put(APP_LEADER + self.layout.mm, struct.pack("<Q", mm))
        self.mapped[mm] = [Vma(code, code + 0x8000, 0, VM_EXEC, 0, program)]

    async def sample(self, regs: Registers, *, stamped: bool) -> Identity:
        """vCPU 0 in a pause that read what ``reads_for`` asked with the window; without the
        task's stamp unless ``stamped`` (the task then trusted by its age, as on a vCPU that
        expected another)."""
        self.transport.pages.update(self.memory.frozen())
        self.transport.calls.clear()
        stamp = self.layout.stamp_range(APP_LEADER)
        asked = self.identifier.reads_for(regs)
        ranges = [r for r in asked if stamped or r != stamp]
        return await self.identifier.identify(self.transport, regs, paused(self.memory, ranges))

    def reads(self) -> list[str]:
        return [call for call in self.transport.calls if call.startswith("read")]


def in_kernel() -> Registers:
    return x86(0, KERNEL.start + 16, STACK + 0x3F00)


def in_user(pc: int) -> Registers:
    return x86(0, pc, 0x7FFF_F000, cpl=3)


async def walked(identity: Identity, pcs: Sequence[int]) -> Identity:
    """The identity a walk of ``identity`` with the user return addresses ``pcs`` ends with."""
    assert identity.reread_mappings is not None
    again = await identity.reread_mappings(pcs)
    assert again is None or isinstance(again, Identity)
    return again or identity


def stamp_read(churn: Churn) -> str:
    """The one read a pause adds for a task it did not expect: the task's stamp."""
    addr, size = churn.layout.stamp_range(APP_LEADER)
    return f"read:{addr:#x}+{size:#x}"


async def test_a_task_struct_the_slab_gave_another_process_is_read_again_in_the_pause(
    layout: TaskLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xz exits; the slab gives its task_struct to a busybox shell, the shell's mm at xz's
    old mm's address. A kernel-mode sample of the task on a vCPU that expected another reads
    its stamp, which is the shell's: the task is read again in the pause, and the sample is
    the shell's even where no walk reaches user code (an xz thread named as the head whose
    task_struct it took, test_riscv64_linux_e2e)."""
    churn = Churn(layout, monkeypatch)
    churn.run(1230, "xz", MM_A, XZ_CODE)
    xz = await churn.sample(in_user(XZ_CODE + 0x10), stamped=True)
    assert xz.process is not None and xz.process.label == "xz (pid 1230)"
    churn.run(1301, "busybox", MM_A, SHELL_CODE)
    found = await churn.sample(in_kernel(), stamped=False)
    assert churn.reads()[0] == stamp_read(churn)
    assert found.process is not None and found.process.label == "busybox (pid 1301)"
    module = found.space.find(SHELL_CODE + 0x20)
    assert module is not None and module.name == "[busybox]"


async def test_an_exec_since_the_task_s_read_is_seen_by_its_stamp(
    layout: TaskLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shell execs xz (same pid, a new mm, a new name) after its task was read: a
    kernel-mode sample on a vCPU that expected another task reads the stamp, and the task is
    read again: xz's, in xz's mappings."""
    churn = Churn(layout, monkeypatch)
    churn.run(1230, "sh", MM_A, SHELL_CODE)
    shell = await churn.sample(in_user(SHELL_CODE + 0x10), stamped=True)
    assert shell.process is not None and shell.process.label == "sh (pid 1230)"
    churn.run(1230, "xz", MM_B, XZ_CODE)
    found = await churn.sample(in_kernel(), stamped=False)
    assert found.process is not None and found.process.label == "xz (pid 1230)"
    module = found.space.find(XZ_CODE + 0x20)
    assert module is not None and module.name == "[xz]"


async def test_a_task_unchanged_costs_a_pause_that_did_not_expect_it_its_stamp_alone(
    layout: TaskLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same task met again where another was expected: its stamp is read, the same, and
    nothing more."""
    churn = Churn(layout, monkeypatch)
    churn.run(1230, "xz", MM_A, XZ_CODE)
    xz = await churn.sample(in_user(XZ_CODE + 0x10), stamped=True)
    again = await churn.sample(in_kernel(), stamped=False)
    assert churn.reads() == [stamp_read(churn)] and again.process == xz.process


async def test_an_exec_into_a_new_mm_at_the_old_one_s_address_is_another_space(
    layout: TaskLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shell execs xz, whose new mm the slab puts at the address the shell's had: same pid,
    same mm, another name. The pause's stamp sees the exec; xz's code, where the shell's was,
    is xz's, not the shell's space answering for an address both map (18abae3)."""
    churn = Churn(layout, monkeypatch)
    churn.run(1230, "sh", MM_A, SHELL_CODE)
    shell = await churn.sample(in_user(SHELL_CODE + 0x10), stamped=True)
    assert shell.process is not None and shell.process.label == "sh (pid 1230)"
    churn.run(1230, "xz", MM_A, SHELL_CODE)
    xz = await churn.sample(in_user(SHELL_CODE + 0x10), stamped=True)
    assert xz.process is not None and xz.process.label == "xz (pid 1230)"
    module = xz.space.find(SHELL_CODE + 0x10)
    assert module is not None and module.name == "[xz]"


async def test_a_walk_its_space_answers_for_reads_nothing_more(
    layout: TaskLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task is read again only for a walk's addresses its space does not answer for:
    one in its mappings, or on a page already found lacking, costs the pause nothing but the
    stamp of a task not expected (d209b10)."""
    churn = Churn(layout, monkeypatch)
    churn.run(1230, "xz", MM_A, XZ_CODE)
    await churn.sample(in_user(XZ_CODE + 0x10), stamped=True)
    lacking = await walked(await churn.sample(in_kernel(), stamped=False), [0x7E00_0000_0000])
    assert churn.reads() != []  # a page no mapping holds: read once...
    trusted = await churn.sample(in_kernel(), stamped=False)
    assert await walked(trusted, [XZ_CODE + 0x20, 0x7E00_0000_0010]) is trusted
    assert churn.reads() == [stamp_read(churn)]  # ...then never again
    assert lacking.process == trusted.process


async def test_a_task_a_register_holds_is_known_by_its_stamp_read_with_the_window(
    layout: TaskLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """riscv64 Linux keeps the current task in tp: a kernel-mode sample asks for that task's
    stamp with its window (in its request), so a task met before costs the pause no read of its
    own, and one exec'd since is still seen by its stamp."""
    churn = Churn(layout, monkeypatch)
    churn.identifier.current = RegisterTask(RISCV64, lambda: 0.0, RECHECK)
    churn.run(1230, "xz", MM_A, XZ_CODE)
    gprs = {2: STACK + 0x3F00, 4: APP_LEADER, 8: 0, RISCV64.pc: KERNEL_PC}
    sample = riscv64_registers(0, gprs, {})
    assert churn.identifier.reads_for(sample) == (layout.stamp_range(APP_LEADER),)
    first = await churn.sample(sample, stamped=True)
    assert first.process is not None and first.process.label == "xz (pid 1230)"
    again = await churn.sample(sample, stamped=True)
    assert churn.reads() == [] and again.process == first.process
    churn.run(1230, "sh", MM_B, SHELL_CODE)
    execd = await churn.sample(sample, stamped=True)
    assert execd.process is not None and execd.process.label == "sh (pid 1230)"
