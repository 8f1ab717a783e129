"""The Linux identifier (qmpprof/linux/running/) over fake guest memory laid out with the offsets
of Debian's 6.12 BTF: the current task of each vCPU, processes by tgid and leader name, kernel
threads and idle, the per-CPU base, the pointer read with the stack and the task only when not
seen recently; the module list; mappings and tasks confirmed between samples."""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import linuxkernel
import pytest
from fakes import FakeTransport, regs, x86
from guestvm import BUILD_ROOT

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.x86 import X86_64
from qmpprof.elf.image import ElfImage
from qmpprof.guest.userfiles import UserFiles
from qmpprof.linux.btf import Btf
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running import current as current_module
from qmpprof.linux.running import spaces as spaces_module
from qmpprof.linux.running.current import CurrentTask, PerCpuVariable, locate_current
from qmpprof.linux.running.identify import MODULES_RECHECK, LinuxIdentifier
from qmpprof.linux.running.linearmap import LinearMap
from qmpprof.linux.running.modules import ModuleLayout, ModuleList
from qmpprof.linux.running.pagetables import X86_64_ENTRIES, PageTables
from qmpprof.linux.running.spaces import Spaces
from qmpprof.linux.running.tasks import PF_KTHREAD, RECHECK, Task, TaskLayout, task_list
from qmpprof.linux.running.vma import VM_EXEC, Vma, VmaLayout
from qmpprof.linux.x86_64.running import X86_64 as X86_64_LINUX
from qmpprof.memory import Reader
from qmpprof.model import Mapping, Process, Registers
from qmpprof.pagecache import PAGE, PageCache, PageMissing
from qmpprof.unwind.space import AddressSpace, Module
from qmpprof.unwind.steps import PrologueStep

PER_CPU_OFFSET = 0xFFFF_FFFF_825E_8E20
BASES = (0xFFFF_8880_3EA0_0000, 0xFFFF_8880_3EB0_0000)
KERNEL = Module(Mapping("vmlinux", 0xFFFF_FFFF_8100_0000, 0xFFFF_FFFF_8300_0000, True))
CURRENT = 0x351C0  # 6.12: pcpu_hot.current_task, the first member (pahole on the same image)


def make(
    layout: TaskLayout | None,
    per_cpu_offset: int | None,
    *,
    vmas: VmaLayout | None = None,
    tables: PageTables | None = None,
    module_list: ModuleList | None = None,
    control: FakeTransport | None = None,
    recheck: float = RECHECK,
    clock: Callable[[], float] = lambda: 0.0,
    linear: LinearMap | None = None,
) -> LinuxIdentifier:
    """The identifier as LinuxGuest.attach puts it together, from these parts."""
    current = CurrentTask(
        CURRENT, per_cpu_offset, X86_64, clock, recheck, X86_64_LINUX.per_cpu_base
    )
    spaces = Spaces(AddressSpace(()), vmas, UserFiles(None), tables, clock)
    return LinuxIdentifier(
        [KERNEL], X86_64, layout=layout, current=current, spaces=spaces,
        module_list=module_list, control=control, thread_size=0x4000, clock=clock,
        recheck=recheck, linear=linear,
    )  # fmt: skip


class Memory:
    """Sparse guest memory, as the pages a FakeTransport serves."""

    def __init__(self) -> None:
        self.pages: dict[int, bytearray] = {}

    def put(self, addr: int, data: bytes) -> None:
        for i, byte in enumerate(data):
            page = (addr + i) & ~(PAGE - 1)
            self.pages.setdefault(page, bytearray(PAGE))[(addr + i) - page] = byte

    def task(
        self, layout: TaskLayout, at: int, pid: int, tgid: int, comm: str, flags: int, leader: int
    ) -> None:
        self.put(at + layout.pid, struct.pack("<i", pid))
        self.put(at + layout.tgid, struct.pack("<i", tgid))
        self.put(at + layout.comm, comm.encode().ljust(16, b"\0"))
        self.put(at + layout.flags, struct.pack("<I", flags))
        self.put(at + layout.group_leader, struct.pack("<Q", leader))

    def frozen(self) -> dict[int, bytes]:
        return {page: bytes(data) for page, data in self.pages.items()}


@pytest.fixture(scope="module")
def layout(linux_vmlinux: ElfImage) -> TaskLayout:
    btf = Btf.from_image(linux_vmlinux)
    assert btf is not None
    return TaskLayout.from_btf(btf)


def guest(layout: TaskLayout, current: tuple[int, int]) -> Memory:
    memory = Memory()
    memory.put(PER_CPU_OFFSET, struct.pack("<2Q", *BASES))
    for base, task in zip(BASES, current, strict=True):
        memory.put(base + CURRENT, struct.pack("<Q", task))
    return memory


@pytest.mark.linux
def test_a_btf_without_variables_takes_the_current_task_from_kallsyms() -> None:
    # 5.10's BTF (Debian bullseye: an older pahole) has no per-CPU variables; 6.1's has, and
    # there both say the same. Both per-CPU areas are zero-based: KASLR does not move them.
    old = LinuxKernel.load(linuxkernel.linux_dir("5.10") / "vmlinuz")
    assert old.per_cpu_start == 0 and old.thread_size == 0x4000
    found, note = locate_current(old)
    assert found == PerCpuVariable(0x1FBC0, False) and note is None
    assert found.link == old.symbols.address_of("current_task") and found.at(0x2000000) == 0x1FBC0
    newer = LinuxKernel.load(linuxkernel.linux_dir("6.1") / "vmlinuz")
    assert locate_current(newer) == (PerCpuVariable(0x1FB80, False), None)


class _Btf:
    """A BTF with one per-CPU variable at ``offset``, or none."""

    def __init__(self, offset: int | None) -> None:
        self.offset = offset

    def percpu(self, name: str) -> tuple[int, int]:
        if self.offset is None or name != "current_task":
            raise KeyError(name)
        return self.offset, 1

    def offset_of(self, path: str) -> int:
        raise KeyError(path)


class _Kernel:
    """What locate_current reads of a kernel: its per-CPU area, BTF and data symbols."""

    def __init__(self, area: int | None, btf: int | None, symbol: int | None) -> None:
        self.per_cpu_start, self.btf = area, _Btf(btf)
        self.data_symbol = {"current_task": symbol}.get


def test_a_per_cpu_area_that_is_ordinary_data_moves_with_the_slide() -> None:
    """7.x: the per-CPU area is linked at an ordinary address (ffffffff83e0c000 on Debian's
    7.2.13), its variables are addresses that KASLR moves; zero-based ones it does not."""
    slide = 0x1E00_0000
    moved, note = locate_current(cast(LinuxKernel, _Kernel(0xFFFF_FFFF_83E0_C000, 0x18018, None)))
    assert moved == PerCpuVariable(0xFFFF_FFFF_83E2_4018, True) and note is None
    assert moved.at(slide) == 0xFFFF_FFFF_83E2_4018 + slide
    from_kallsyms, _ = locate_current(
        cast(LinuxKernel, _Kernel(0xFFFF_FFFF_83E0_C000, None, 0xFFFF_FFFF_83E2_4018))
    )
    assert from_kallsyms == moved
    odd = _Kernel(0xFFFF_FFFF_83E0_C000, 0x18018, 0xFFFF_FFFF_83E2_4020)
    assert "kallsyms at 0xffffffff83e24020: BTF taken" in (
        locate_current(cast(LinuxKernel, odd))[1] or ""
    )
    with pytest.raises(KeyError, match="current_task"):
        locate_current(cast(LinuxKernel, _Kernel(0, None, None)))


APP_LEADER, APP_THREAD = 0xFFFF_8880_0100_0000, 0xFFFF_8880_0100_4000
KWORKER, IDLE = 0xFFFF_8880_0200_0000, 0xFFFF_FFFF_82C1_0940


def test_the_layout_of_debian_612(layout: TaskLayout, linux_vmlinux: ElfImage) -> None:
    # pahole on the same image (tests/unit/test_linux_btf.py checks the BTF reader against it).
    kernel = LinuxKernel.load(linuxkernel.linux_dir("6.12") / "vmlinuz")
    assert locate_current(kernel) == (PerCpuVariable(CURRENT, False), None)
    assert (layout.pid, layout.tgid, layout.comm, layout.comm_size) == (2432, 2436, 2976, 16)


async def test_threads_belong_to_their_process_and_kernel_threads_are_bracketed(
    layout: TaskLayout,
) -> None:
    memory = guest(layout, (APP_THREAD, KWORKER))
    memory.task(layout, APP_LEADER, 1230, 1230, "myapp", 0, APP_LEADER)
    memory.task(layout, APP_THREAD, 1234, 1230, "worker", 0, APP_LEADER)
    memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
    transport = FakeTransport({}, memory.frozen())
    identifier = make(layout, PER_CPU_OFFSET)
    user = await identifier.identify(transport, regs(0, 0x40_1000), PageCache())
    kthread = await identifier.identify(transport, regs(1, KERNEL.start + 16), PageCache())
    assert user.process == Process(1230, "myapp", 0, 1234, "worker")  # the leader's name
    assert kthread.process == Process(55, "[kworker/1:0]", 0, 55, "kworker/1:0")
    assert user.process.label == "myapp (pid 1230)"
    assert user.space is kthread.space is identifier.space


async def test_the_pointer_goes_with_the_stack_and_the_task_is_read_again_when_stale(
    layout: TaskLayout,
) -> None:
    memory = guest(layout, (IDLE, KWORKER))
    memory.task(layout, IDLE, 0, 0, "swapper/0", PF_KTHREAD, IDLE)
    memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
    now = [0.0]
    transport = FakeTransport({}, memory.frozen())
    identifier = make(layout, PER_CPU_OFFSET, clock=lambda: now[0])
    r0 = regs(0, KERNEL.start + 16)
    assert identifier.reads_for(r0) == ()  # the per-CPU base is not known yet
    assert (await identifier.identify(transport, r0, PageCache())).process == Process(
        0, "swapper/0", 0, 0, "swapper/0"
    )
    # The pointer, and the stamp of the task expected (the vCPU's last), with the window.
    assert identifier.reads_for(r0) == ((BASES[0] + CURRENT, 8), layout.stamp_range(IDLE))
    # Within RECHECK, with the window, the pointer and the stamp identify the task; a
    # kernel-mode pause without the stamp (it expected another task) reads it, no more.
    transport.calls.clear()
    await identifier.identify(transport, r0, paused(memory, identifier.reads_for(r0)))
    assert [c for c in transport.calls if c.startswith("read")] == []
    await identifier.identify(transport, r0, PageCache())
    stamp, size = layout.stamp_range(IDLE)
    assert [c for c in transport.calls if c.startswith("read")] == [
        f"read:{BASES[0] + CURRENT:#x}+0x8",  # the pointer, not its page
        f"read:{stamp:#x}+{size:#x}",
    ]
    # Past it, the task is read again: the pid changed (the pointer now holds another task).
    memory.task(layout, IDLE, 77, 77, "kworker/0:2", PF_KTHREAD, IDLE)
    transport.pages.update(memory.frozen())
    now[0] = 1.0
    again = await identifier.identify(transport, r0, PageCache())
    assert again.process == Process(77, "[kworker/0:2]", 0, 77, "kworker/0:2")


async def test_without_per_cpu_offsets_the_gs_base_of_kernel_mode_serves(
    layout: TaskLayout,
) -> None:
    memory = guest(layout, (KWORKER, KWORKER))
    memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
    transport = FakeTransport({}, memory.frozen())
    identifier = make(layout, None)
    user = regs(0, 0x40_1000)  # user mode: GS is the user's, no base to learn
    assert (await identifier.identify(transport, user, PageCache())).process is None

    kernel = x86(0, KERNEL.start + 16, gs_base=BASES[0])
    assert (await identifier.identify(transport, kernel, PageCache())).process == Process(
        55, "[kworker/1:0]", 0, 55, "kworker/1:0"
    )


async def test_without_btf_every_sample_is_the_kernel_s() -> None:
    identifier = make(None, PER_CPU_OFFSET)
    found = await identifier.identify(FakeTransport({}, {}), regs(0, 0x40_1000), PageCache())
    assert found.process is None and identifier.reads_for(regs(0, 0x40_1000)) == ()


HEAD = 0xFFFF_FFFF_82E0_0000  # the kernel's `modules` list head
ALPHA, BETA = 0xFFFF_FFFF_C000_1000, 0xFFFF_FFFF_C000_9000  # struct module of each


@pytest.fixture(scope="module")
def module_layout(linux_vmlinux: ElfImage) -> ModuleLayout:
    btf = Btf.from_image(linux_vmlinux)
    assert btf is not None
    return ModuleLayout.from_btf(btf)


def link(memory: Memory, layout: ModuleLayout, chain: list[int]) -> None:
    """The circular list from HEAD through each struct module's ``list`` member."""
    nodes = [HEAD, *(at + layout.list for at in chain)]
    for node, following in zip(nodes, [*nodes[1:], HEAD], strict=True):
        memory.put(node, struct.pack("<Q", following))


def module(memory: Memory, layout: ModuleLayout, at: int, name: str, text: int) -> None:
    """A module of 0x2000 bytes of text (zeros), without symbols or ORC tables."""
    memory.put(at + layout.name, name.encode().ljust(layout.name_size, b"\0"))
    memory.put(at + layout.text_base, struct.pack("<Q", text))
    memory.put(at + layout.text_size, struct.pack("<I", 0x2000))
    memory.put(at + layout.kallsyms, bytes(8))
    if layout.orc is not None:
        memory.put(at + layout.orc[0], bytes(4))
    memory.put(text, bytes(0x2000))


def reader(memory: Memory, reads: list[int]) -> Reader:
    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for addr, size in ranges:
            reads.append(addr)
            data = PageCache()
            data.pages = dict(memory.frozen())
            try:
                out.append(data.read(addr, size))
            except PageMissing:
                out.append(None)
        return out

    return read


async def test_the_module_list_is_read_again_by_its_links_and_only_new_modules_in_full(
    module_layout: ModuleLayout,
) -> None:
    memory, reads = Memory(), []
    module(memory, module_layout, ALPHA, "alpha", 0xFFFF_FFFF_C010_0000)
    module(memory, module_layout, BETA, "beta", 0xFFFF_FFFF_C020_0000)
    link(memory, module_layout, [ALPHA])
    modules = ModuleList(reader(memory, reads), HEAD, module_layout, None, X86_64)
    assert [m.name for m in await modules.refresh() or []] == ["[alpha]"]
    reads.clear()
    assert await modules.refresh() is None  # the same list: its two links read, nothing else
    assert reads == [HEAD, ALPHA + module_layout.list]
    link(memory, module_layout, [BETA, ALPHA])  # a module is loaded: it goes first
    reads.clear()
    assert [m.name for m in await modules.refresh() or []] == ["[beta]", "[alpha]"]
    assert ALPHA + module_layout.name not in reads and BETA + module_layout.name in reads
    link(memory, module_layout, [BETA])  # and one unloaded
    assert [m.name for m in await modules.refresh() or []] == ["[beta]"]


async def test_housekeeping_takes_in_a_module_loaded_during_the_run(
    layout: TaskLayout, module_layout: ModuleLayout
) -> None:
    memory = guest(layout, (KWORKER, KWORKER))
    memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
    module(memory, module_layout, ALPHA, "alpha", 0xFFFF_FFFF_C010_0000)
    link(memory, module_layout, [])
    now = [0.0]
    modules = ModuleList(reader(memory, []), HEAD, module_layout, None, X86_64)
    assert await modules.refresh() == []
    identifier = make(layout, PER_CPU_OFFSET, module_list=modules, clock=lambda: now[0])
    transport = FakeTransport({}, memory.frozen())
    before = await identifier.identify(transport, regs(0, KERNEL.start + 16), PageCache())
    assert before.space.find(0xFFFF_FFFF_C010_0010) is None
    link(memory, module_layout, [ALPHA])
    now[0] = MODULES_RECHECK / 2
    await identifier.housekeep()  # not yet due
    assert identifier.space is before.space
    now[0] = MODULES_RECHECK
    await identifier.housekeep()
    after = await identifier.identify(transport, regs(0, KERNEL.start + 16), PageCache())
    found = after.space.find(0xFFFF_FFFF_C010_0010)
    assert found is not None and found.name == "[alpha]"
    assert after.process == before.process  # the task read again, with the new space


async def test_mappings_are_confirmed_between_samples_so_pauses_need_not_read_them(
    layout: TaskLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    mm = 0xFFFF_8880_0500_0000
    memory = guest(layout, (APP_LEADER, APP_LEADER))
    memory.task(layout, APP_LEADER, 1230, 1230, "myapp", 0, APP_LEADER)
    memory.put(APP_LEADER + layout.mm, struct.pack("<Q", mm))
    transport, control = FakeTransport({}, memory.frozen()), FakeTransport({}, {})
    mapped = [Vma(0x40_0000, 0x40_1000, 0, VM_EXEC, 0, None)]
    reads: list[str] = []

    async def vmas_of(read: Reader, at: int, _layout: object, _end: int) -> list[Vma]:
        assert at == mm
        await read([(at, 8)])  # through the transport it was given
        reads.append("control" if control.calls else "pause")
        control.calls.clear()
        return list(mapped)

    monkeypatch.setattr(spaces_module, "read_exec_vmas", vmas_of)
    monkeypatch.setattr(control, "read", _counting(control))
    now = [0.0]
    identifier = make(
        layout, PER_CPU_OFFSET, vmas=cast(VmaLayout, SimpleNamespace(pgd=0x48, map_count=0x50)),
        control=control, recheck=0.1, clock=lambda: now[0],
    )  # fmt: skip

    async def sample() -> None:
        await identifier.identify(transport, regs(0, 0x40_0010), PageCache())

    await sample()
    assert reads == ["pause"]
    for now[0] in (2.0, 3.0, 6.0, 8.0):  # confirmed at 3.0 and 6.0 (at 8.0 not yet due)
        await identifier.housekeep()
        await sample()
    assert reads == ["pause", "control", "control"]  # no pause read the mappings again
    mapped.append(Vma(0x7F00_0000_0000, 0x7F00_0000_1000, 0, VM_EXEC, 0, None))  # dlopen
    now[0] = 9.0
    await identifier.housekeep()
    await sample()
    assert reads[-2:] == ["control", "pause"], reads  # changed: the next sample reads them
    now[0] = 30.0  # no sample of it for long: not looked at any more
    await identifier.housekeep()
    assert reads[-1] == "pause"


async def test_between_samples_kernel_memory_no_vcpu_maps_is_read_through_the_linear_map(
    layout: TaskLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each vCPU in user mode while the guest runs (arm64's KPTI unmaps the kernel at EL0):
    housekeeping reads the kernel physically through the linear map. A file's name that did
    not read so had left xz's libc unnamed (``[anon]``) for 16 samples (CI, arm64 6.12)."""
    mm, file, name_at = 0xFFFF_8880_0500_0000, 0xFFFF_8880_0700_0000, 0xFFFF_8880_0700_0100
    offset = 0xFFFF_8880_0000_0000  # the linear map: kernel address - physical
    memory = guest(layout, (APP_LEADER, APP_LEADER))
    memory.task(layout, APP_LEADER, 1230, 1230, "myapp", 0, APP_LEADER)
    memory.put(APP_LEADER + layout.mm, struct.pack("<Q", mm))
    memory.put(name_at, b"libc.so.6\0")
    transport, control = FakeTransport({}, memory.frozen()), FakeTransport({}, {})
    control.physical = {page - offset: data for page, data in memory.frozen().items()}
    names: list[str | None] = []

    async def vmas_of(read: Reader, at: int, _layout: object, _end: int) -> list[Vma]:
        (raw,) = await read([(name_at, 9)])
        names.append(None if raw is None else raw.decode())
        return [Vma(0x40_0000, 0x40_1000, 0, VM_EXEC, file, names[-1])]

    monkeypatch.setattr(spaces_module, "read_exec_vmas", vmas_of)
    now = [0.0]
    identifier = make(
        layout, PER_CPU_OFFSET, vmas=cast(VmaLayout, SimpleNamespace(pgd=0x48, map_count=0x50)),
        control=control, recheck=0.1, clock=lambda: now[0],
        linear=LinearMap(offset, offset + (1 << 40), offset),
    )  # fmt: skip
    await identifier.identify(transport, regs(0, 0x40_0010), PageCache())
    now[0] = 3.0  # confirmed: read between samples
    await identifier.housekeep()
    assert names == ["libc.so.6", "libc.so.6"] and "read_physical" in control.calls


async def test_tasks_are_confirmed_between_samples_so_pauses_read_only_new_ones(
    layout: TaskLayout,
) -> None:
    memory = guest(layout, (KWORKER, KWORKER))
    memory.task(layout, KWORKER, 55, 55, "kworker/0:1", PF_KTHREAD, KWORKER)
    transport = FakeTransport({}, memory.frozen())
    control = FakeTransport({}, memory.frozen())  # reads while the guest runs
    now = [0.0]
    identifier = make(layout, PER_CPU_OFFSET, control=control, clock=lambda: now[0])
    r0 = regs(0, KERNEL.start + 16)
    pointer = f"read:{BASES[0] + CURRENT:#x}+0x8"

    async def pause_reads() -> list[str]:
        transport.calls.clear()
        window = paused(memory, identifier.reads_for(r0))  # the stamp, once the task is known
        found = await identifier.identify(transport, r0, window)
        assert found.process is not None
        return [c for c in transport.calls if c.startswith("read") and c != pointer]

    assert await pause_reads()  # the first sample reads the task (and the per-CPU base)
    for now[0] in (RECHECK * 0.8, RECHECK * 1.6, RECHECK * 2.4, RECHECK * 3.2):
        control.calls.clear()
        await identifier.housekeep()
        assert [c for c in control.calls if c.startswith("read")], now[0]  # confirmed
        assert await pause_reads() == [], now[0]  # so no pause reads it again
    # Another task behind the same pointer (the kworker exited, its memory reused): the
    # confirmation sees it, and the next sample reads the new one's fields.
    memory.task(layout, KWORKER, 88, 88, "kworker/0:3", PF_KTHREAD, KWORKER)
    control.pages.update(memory.frozen())
    transport.pages.update(memory.frozen())
    now[0] = RECHECK * 4.0
    await identifier.housekeep()
    assert await pause_reads()
    assert (await identifier.identify(transport, r0, PageCache())).process == Process(
        88, "[kworker/0:3]", 0, 88, "kworker/0:3"
    )
    # Not sampled for long: not read by housekeeping any more.
    now[0] = RECHECK * 12
    control.calls.clear()
    await identifier.housekeep()
    assert not [c for c in control.calls if c.startswith("read")]


class _Tables:
    """PageTables' reader, recording which page tables it was asked to read through."""

    user_end = 1 << 47
    direct_map, levels = 0xFFFF_8880_0000_0000, 4
    entries = X86_64_ENTRIES

    def __init__(self) -> None:
        self.pgds: list[int] = []

    def reader(self, pgd: int) -> Reader:
        self.pgds.append(pgd)

        async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
            return [b"\x55" * n for _, n in ranges]

        return read

    def over(self, read: Reader) -> _Tables:
        return self

    def forget(self) -> None:
        pass


async def test_preload_places_every_process_before_the_first_stop(
    layout: TaskLayout, linux_vmlinux: ElfImage, monkeypatch: pytest.MonkeyPatch
) -> None:
    btf = Btf.from_image(linux_vmlinux)
    assert btf is not None
    vmas = VmaLayout.from_btf(btf)
    init, mm, pgd = 0xFFFF_FFFF_82C0_0000, 0xFFFF_8880_0500_0000, 0xFFFF_8880_0600_0000
    memory = guest(layout, (APP_LEADER, KWORKER))
    memory.task(layout, init, 0, 0, "swapper/0", PF_KTHREAD, init)
    memory.task(layout, APP_LEADER, 1230, 1230, "myapp", 0, APP_LEADER)
    memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
    memory.put(APP_LEADER + layout.mm, struct.pack("<Q", mm))
    memory.put(mm + vmas.pgd, struct.pack("<Q", pgd))
    ring = [init, APP_LEADER, KWORKER, init]  # the task list, through task_struct.tasks
    for task, following in itertools.pairwise(ring):
        memory.put(task + layout.tasks, struct.pack("<Q", following + layout.tasks))

    async def vmas_of(read: Reader, at: int, _layout: object, _end: int) -> list[Vma]:
        assert at == mm
        return [Vma(0x40_0000, 0x40_1000, 0, VM_EXEC, 0, "myapp")]

    monkeypatch.setattr(spaces_module, "read_exec_vmas", vmas_of)
    control, transport = FakeTransport({}, memory.frozen()), FakeTransport({}, memory.frozen())
    tables = _Tables()
    identifier = make(
        layout, PER_CPU_OFFSET, vmas=vmas, control=control, tables=cast(PageTables, tables)
    )
    read = reader(memory, [])
    assert identifier.current is not None
    await identifier.current.preload(read, [0, 1])
    await identifier.preload(read, await task_list(read, init, layout))
    assert tables.pgds == [pgd]  # the code probe went through the process's own tables
    # The first stop: each vCPU's pointer is read with its stack; nothing else but, in kernel
    # mode, the stamp of a task no earlier sample there expected.
    for cpu, rip in ((0, 0x40_0010), (1, KERNEL.start + 16)):
        r = regs(cpu, rip)
        assert identifier.reads_for(r) == ((BASES[cpu] + CURRENT, 8),)
        seen = PageCache()
        seen.pieces[BASES[cpu] + CURRENT] = (
            8,
            struct.pack("<Q", (APP_LEADER, KWORKER)[cpu]),
        )
        transport.calls.clear()
        found = await identifier.identify(transport, r, seen)
        stamp, size = layout.stamp_range(KWORKER)
        assert [c for c in transport.calls if c.startswith("read")] == (
            [] if cpu == 0 else [f"read:{stamp:#x}+{size:#x}"]
        )
        assert found.process is not None and found.process.pid == (1230, 55)[cpu]
        if cpu == 0:
            assert found.space.find(0x40_0010) is not None  # [myapp], placed


@pytest.mark.parametrize(
    ("cr3", "where", "foreign"),
    [
        (0x600_0000 | 5, "own stack", False),  # its own tables (PCID 5)
        (0x600_1000 | 5 | 1 << 63, "own stack", False),  # PTI's user copy, no-flush bit set
        (0x700_0000 | 5, "own stack", True),  # another's: a context switch caught midway
        (0x700_0000 | 5, "next's stack", False),  # past the stacks' switch: the next's walk
        (0x700_0000 | 5, "user", False),  # user code runs on its own: the register says more
    ],
)
async def test_a_task_on_another_process_tables_is_read_through_its_own(
    layout: TaskLayout,
    linux_vmlinux: ElfImage,
    monkeypatch: pytest.MonkeyPatch,
    cr3: int,
    where: str,
    foreign: bool,
) -> None:
    """Between switch_mm loading the next process's page tables and the stacks' switch, the
    current task is still the one whose stack is walked: its user memory must be read through
    its own tables (mm->pgd), not the vCPU's."""
    user, stack = where == "user", 0xFFFF_C900_0001_0000
    btf = Btf.from_image(linux_vmlinux)
    assert btf is not None
    vmas = VmaLayout.from_btf(btf)
    mm, pgd = 0xFFFF_8880_0500_0000, 0xFFFF_8880_0600_0000
    memory = guest(layout, (APP_LEADER, KWORKER))
    memory.task(layout, APP_LEADER, 1230, 1230, "myapp", 0, APP_LEADER)
    memory.put(APP_LEADER + layout.mm, struct.pack("<Q", mm))
    memory.put(mm + vmas.pgd, struct.pack("<Q", pgd))
    memory.put(APP_LEADER + layout.stack, struct.pack("<Q", stack))

    async def vmas_of(read: Reader, at: int, _layout: object, _end: int) -> list[Vma]:
        return [Vma(0x40_0000, 0x40_1000, 0, VM_EXEC, 0, "myapp")]

    monkeypatch.setattr(spaces_module, "read_exec_vmas", vmas_of)
    transport = FakeTransport({}, memory.frozen())
    tables = _Tables()
    identifier = make(layout, PER_CPU_OFFSET, vmas=vmas, tables=cast(PageTables, tables))
    rip = 0x40_0010 if user else KERNEL.start + 16
    sp = stack + (0x3F00 if where == "own stack" else 0x9000)
    found = await identifier.identify(
        transport, x86(0, rip, sp, cpl=3 if user else 0, cr3=cr3), PageCache()
    )
    assert found.process is not None and found.process.pid == 1230
    assert (found.memory is not None) == foreign
    if found.memory is not None:
        tables.pgds.clear()
        (page,) = await found.memory([(0x7FFF_0000_0000, 8)])
        assert page is None and tables.pgds == []  # read through a walk of its own tables
    if user:  # the process's root is not trusted until read again
        found = await identifier.identify(
            transport, x86(0, KERNEL.start, stack + 0x3F00, cr3=cr3), PageCache()
        )
        assert found.memory is None


async def test_a_sample_past_the_switch_of_stacks_is_the_next_tasks(
    layout: TaskLayout, linux_vmlinux: ElfImage
) -> None:
    """In a context switch, the stack pointer moves to the next task's stack a little before
    ``current`` changes: a sample there is the next task's (read before: on vCPU 1), not the
    current one's; one on a stack no task read owns (an interrupt's) stays the current's."""
    app_stack, kworker_stack = 0xFFFF_C900_0001_0000, 0xFFFF_C900_0002_0000
    memory = guest(layout, (APP_LEADER, KWORKER))
    memory.task(layout, APP_LEADER, 1230, 1230, "myapp", 0, APP_LEADER)
    memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
    memory.put(APP_LEADER + layout.stack, struct.pack("<Q", app_stack))
    memory.put(KWORKER + layout.stack, struct.pack("<Q", kworker_stack))
    transport = FakeTransport({}, memory.frozen())
    identifier = make(layout, PER_CPU_OFFSET)

    async def pid(cpu: int, sp: int) -> int | None:
        found = await identifier.identify(transport, regs(cpu, KERNEL.start, sp), PageCache())
        return None if found.process is None else found.process.pid

    assert await pid(1, kworker_stack + 0x3000) == 55
    assert await pid(0, app_stack + 0x3000) == 1230
    assert await pid(0, kworker_stack + 0x3E00) == 55  # current is still myapp
    assert await pid(0, 0xFFFF_FE00_0000_8000) == 1230  # an interrupt stack


def _counting(transport: FakeTransport) -> Callable[[int, int, int], Awaitable[bytes]]:
    async def read(cpu: int, addr: int, size: int) -> bytes:
        transport.calls.append(f"read:{addr:#x}")
        return bytes(size)

    return read


def paused(memory: Memory, ranges: Sequence[tuple[int, int]]) -> PageCache:
    """What a pause read with the stack window: ``ranges`` of ``memory``."""
    cache = PageCache()
    for addr, size in ranges:
        data = bytearray()
        for at in range(addr, addr + size):
            page = memory.pages.get(at & ~(PAGE - 1), bytearray(PAGE))
            data.append(page[at & (PAGE - 1)])
        cache.pieces[addr] = (size, bytes(data))
    return cache


async def test_the_task_expected_is_verified_by_its_stamp_read_with_the_window(
    layout: TaskLayout,
) -> None:
    memory = guest(layout, (KWORKER, APP_LEADER))
    memory.task(layout, KWORKER, 55, 55, "kworker/0:1", PF_KTHREAD, KWORKER)
    memory.task(layout, APP_LEADER, 1230, 1230, "myapp", 0, APP_LEADER)
    memory.put(APP_LEADER + layout.mm, struct.pack("<Q", 0xFFFF_8880_0500_0000))
    stack = 0xFFFF_C900_0001_0000
    memory.put(KWORKER + layout.stack, struct.pack("<Q", stack))
    now = [0.0]
    transport = FakeTransport({}, memory.frozen())
    identifier = make(layout, PER_CPU_OFFSET, clock=lambda: now[0])
    on_stack = regs(0, KERNEL.start + 16, rsp=stack + 0x3F00)
    irq = regs(0, KERNEL.start + 16, rsp=0xFFFF_C900_0000_0F00)  # this CPU's interrupt stack
    user = regs(1, 0x40_1000, rsp=0x7FFF_F000)
    pointer = [(base + CURRENT, 8) for base in BASES]

    async def sample(r: Registers) -> tuple[Process | None, list[str]]:
        """One vCPU's identity in a pause that read what reads_for asked, and what it read."""
        transport.pages.update(memory.frozen())
        transport.calls.clear()
        found = await identifier.identify(transport, r, paused(memory, identifier.reads_for(r)))
        return found.process, [c for c in transport.calls if c.startswith("read")]

    first, reads = await sample(on_stack)  # the per-CPU base, the pointer, the task: read
    assert first is not None and first.pid == 55 and reads
    # On its own stack the kworker is expected: its stamp comes with the pointer and the
    # window, and it is the same: nothing else is read, now or long after RECHECK.
    assert identifier.reads_for(on_stack) == (pointer[0], layout.stamp_range(KWORKER))
    for now[0] in (0.1, RECHECK * 3, RECHECK * 9):
        assert await sample(on_stack) == (first, [])
    # Elsewhere on the vCPU (an interrupt stack), the vCPU's last task is expected.
    assert identifier.reads_for(irq) == (pointer[0], layout.stamp_range(KWORKER))
    app, _ = await sample(user)
    assert app == Process(1230, "myapp", 0, 1230, "myapp")
    assert identifier.reads_for(user) == (pointer[1], layout.stamp_range(APP_LEADER))
    # An exec: another program in another mm, the same task. Its stamp changed: read again.
    # The kernel gives the task its new mm first, its new name after (begin_new_exec): the
    # name is in the stamp too, so the parent's name read in between does not stay.
    memory.put(APP_LEADER + layout.mm, struct.pack("<Q", 0xFFFF_8880_0700_0000))
    midway, reads = await sample(user)
    assert midway == Process(1230, "myapp", 0, 1230, "myapp") and reads
    memory.task(layout, APP_LEADER, 1230, 1230, "xz", 0, APP_LEADER)
    memory.put(APP_LEADER + layout.mm, struct.pack("<Q", 0xFFFF_8880_0700_0000))
    execd, reads = await sample(user)
    assert execd == Process(1230, "xz", 0, 1230, "xz") and reads
    # The task exited and its task_struct holds the next process at once (same mm address,
    # as it may be): the pid tells.
    memory.task(layout, APP_LEADER, 1301, 1301, "head", 0, APP_LEADER)
    reused, reads = await sample(user)
    assert reused == Process(1301, "head", 0, 1301, "head") and reads
    assert await sample(user) == (reused, [])
    # The task moved to vCPU 0, which expected its kworker: no stamp of the task, which is
    # trusted by its age, but not at a user pc its space lacks (an exec the stamp did not see).
    memory.put(BASES[0] + CURRENT, struct.pack("<Q", APP_LEADER))
    moved, reads = await sample(replace(user, cpu=0, sp=0x7FFF_D000))  # a page not seen
    assert moved == reused and reads


MYAPP_MM = 0xFFFF_8880_0500_0000  # the mm_struct of myapp, its one process
MYAPP_PGD_AT = 0x58  # mm_struct.pgd


def myapp_mapped(monkeypatch: pytest.MonkeyPatch) -> list[Vma]:
    """myapp's executable mappings, as every read of them gives them (the list, changed in
    place, is read anew each time)."""
    mapped = [Vma(0x40_0000, 0x40_8000, 0, VM_EXEC, 0, "myapp")]

    async def vmas_of(read: Reader, at: int, _layout: object, _end: int) -> list[Vma]:
        return list(mapped)

    monkeypatch.setattr(spaces_module, "read_exec_vmas", vmas_of)
    return mapped


class MyappTables(_Tables):
    """Page tables under which myapp's code is ``program``'s, loaded at 0x400000."""

    def __init__(self, program: Path) -> None:
        super().__init__()
        self.program = program

    def reader(self, pgd: int) -> Reader:
        self.pgds.append(pgd)

        async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
            image = ElfImage.load(self.program)
            return [image.file_bytes(a - 0x40_0000, n) for a, n in ranges]

        return read


def myapp_spaces(files: UserFiles, tables: PageTables | None) -> tuple[Spaces, Task]:
    vmas = cast(VmaLayout, SimpleNamespace(pgd=MYAPP_PGD_AT, map_count=0x50))
    spaces = Spaces(AddressSpace([KERNEL]), vmas, files, tables, lambda: 0.0)
    return spaces, Task(1230, 1230, "myapp", False, "myapp", MYAPP_MM, 0)


async def test_a_process_met_in_a_pause_with_an_unread_file_is_placed_when_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guest_build: None
) -> None:
    """No file is read inside a pause: the process is placed without it (its code known by
    the mapping's name), the name noted; between samples the file is read and the process
    placed again through its own page tables."""
    program = BUILD_ROOT / "cfi" / "user" / "spin.elf"
    (tmp_path / "myapp").write_bytes(program.read_bytes())
    files = UserFiles(tmp_path)
    mm, pgd = MYAPP_MM, 0xFFFF_8880_0600_0000
    myapp_mapped(monkeypatch)

    tables = MyappTables(program)
    spaces, task = myapp_spaces(files, cast(PageTables, tables))
    memory = Memory()
    memory.put(mm + MYAPP_PGD_AT, struct.pack("<Q", pgd))
    read, reads = reader(memory, []), []
    first = await spaces.space_of(reader(memory, reads), task)
    module = first.find(0x40_1000)
    assert module is not None and module.name == "[myapp]" and module.mapping.path is None
    assert files.unread == {"myapp"} and not files.read("myapp")
    assert await spaces.space_of(read, task) is first  # not placed again meanwhile
    await spaces.settle(read)
    # Its tables: for the pause's probe (the vCPU showed no code), then to place it.
    assert files.read("myapp") and not files.unread and tables.pgds == [pgd, pgd]
    again = (await spaces.space_of(read, task)).find(0x40_1000)
    assert again is not None and again.name == "myapp" and again.mapping.path is not None


async def test_a_process_waiting_for_its_files_is_placed_with_them_right_after_the_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guest_build: None
) -> None:
    """A program started since the run began, met in a pause before its file was read: after
    cont (``complete``) its files are read and it is placed again through its own tables, for
    the pause's walk to be walked again in; once placed, nothing more is asked."""
    program = BUILD_ROOT / "cfi" / "user" / "spin.elf"
    (tmp_path / "myapp").write_bytes(program.read_bytes())
    files = UserFiles(tmp_path)
    mm, pgd = MYAPP_MM, 0xFFFF_8880_0600_0000
    myapp_mapped(monkeypatch)

    spaces, task = myapp_spaces(files, cast(PageTables, MyappTables(program)))
    memory = Memory()
    memory.put(mm + MYAPP_PGD_AT, struct.pack("<Q", pgd))
    read = reader(memory, [])
    first = await spaces.space_of(read, task)
    assert spaces.waiting(task) and first.find(0x40_1000).mapping.path is None  # type: ignore[union-attr]
    placed = await spaces.complete(read, task)
    assert placed is not None and not spaces.waiting(task) and not files.unread
    module = placed.find(0x40_1000)
    assert module is not None and module.name == "myapp" and module.mapping.path is not None
    assert await spaces.space_of(read, task) is placed
    assert await spaces.complete(read, task) is None  # not waiting any more


async def test_code_a_pause_cannot_see_is_compared_through_the_process_s_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guest_build: None
) -> None:
    """An arm64 vCPU in kernel mode reads no user page (PAN): the code of a process met in a
    kernel-mode sample is compared with its file through the process's own tables, so that
    it is placed in that pause, not named by its mapping alone."""
    program = BUILD_ROOT / "cfi" / "user" / "spin.elf"
    (tmp_path / "myapp").write_bytes(program.read_bytes())
    files = UserFiles(tmp_path)
    files.candidates("myapp")  # read before: only the pause's view of memory is at stake
    mm, pgd = MYAPP_MM, 0xFFFF_8880_0600_0000
    myapp_mapped(monkeypatch)
    walked: list[int] = []

    class Tables(_Tables):
        walk: Reader | None = None  # what the tables are read through (a pause's reads)

        def over(self, read: Reader) -> Tables:
            self.walk = read
            return self

        def reader(self, pgd: int) -> Reader:
            self.pgds.append(pgd)

            async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
                assert self.walk is not None
                (top,) = await self.walk([(pgd, 8)])  # the top level, in kernel memory
                assert top is not None
                walked.extend(a for a, _ in ranges)
                return [ElfImage.load(program).file_bytes(a - 0x40_0000, n) for a, n in ranges]

            return read

    tables = Tables()
    spaces, task = myapp_spaces(files, cast(PageTables, tables))
    memory = Memory()  # the kernel's: no user page in it
    memory.put(mm + MYAPP_PGD_AT, struct.pack("<Q", pgd))
    memory.put(pgd, struct.pack("<Q", 0x4003))
    space = await spaces.space_of(reader(memory, []), task)
    module = space.find(0x40_1000)
    assert module is not None and module.name == "myapp" and module.mapping.path is not None
    assert tables.pgds == [pgd] and walked == [0x40_0000]


def counted_vmas(monkeypatch: pytest.MonkeyPatch, mapped: list[Vma]) -> list[int]:
    """``mapped`` as any process's mappings; the mm of each read of them, in a list."""
    reads: list[int] = []

    async def vmas_of(read: Reader, at: int, _layout: object, _end: int) -> list[Vma]:
        reads.append(at)
        return list(mapped)

    monkeypatch.setattr(spaces_module, "read_exec_vmas", vmas_of)
    return reads


def myapp_alone() -> Spaces:
    """Spaces with no files and no page tables."""
    vmas = cast(VmaLayout, SimpleNamespace(pgd=0x58, map_count=0x50))
    return Spaces(AddressSpace([KERNEL]), vmas, UserFiles(None), None, lambda: 0.0)


async def test_a_user_pc_no_mapping_holds_has_the_mappings_read_again_once_per_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that has just started maps its libraries one after the other: a sample at a
    pc (or a walk with a return address) its mappings as read lack reads them again; a page
    still lacking is not read again."""
    mm = 0xFFFF_8880_0500_0000
    mapped = [Vma(0x40_0000, 0x40_8000, 0, VM_EXEC, 0, "myapp")]
    reads = counted_vmas(monkeypatch, mapped)
    spaces = myapp_alone()
    task = Task(1230, 1230, "myapp", False, "myapp", mm, 0)
    read = reader(Memory(), [])
    await spaces.space_of(read, task, [0x40_1000])
    assert reads == [mm]
    await spaces.space_of(read, task, [0x40_2000])  # held: nothing read
    assert reads == [mm] and spaces.holds(task, [0x40_2000])
    mapped.append(Vma(0x7F00_0000_0000, 0x7F00_0002_0000, 0, VM_EXEC, 0, "libc.so.6"))
    assert not spaces.holds(task, [0x40_2000, 0x7F00_0000_1234])
    libc = await spaces.space_of(read, task, [0x7F00_0000_1234])  # mapped since: read again
    assert reads == [mm, mm] and libc.find(0x7F00_0000_1234) is not None
    await spaces.space_of(read, task, [0x7E00_0000_0000])  # in no mapping: read once...
    await spaces.space_of(read, task, [0x7E00_0000_0010])  # ...not again for that page
    assert reads == [mm, mm, mm] and spaces.holds(task, [0x7E00_0000_0020, 0x40_1000])
    # Several addresses of a walk: one read for all, their lacking pages kept together.
    await spaces.space_of(read, task, [0x40_1000, 0x7D00_0000_0000, 0x7C00_0000_0000])
    assert reads == [mm, mm, mm, mm]
    assert spaces.holds(task, [0x7D00_0000_0008, 0x7C00_0000_0008, 0x7E00_0000_0000])


async def test_a_mapping_whose_file_name_did_not_read_is_read_again_at_the_next_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file's name that did not read (the kernel unmapped under the vCPU that read it) leaves
    its mapping unnamed: not trusted, the next sample reads the mappings again; named, they
    are trusted."""
    mm = 0xFFFF_8880_0500_0000
    mapped = [Vma(0x40_0000, 0x40_8000, 0, VM_EXEC, 0xFFFF_8880_0700_0000, None)]
    reads = counted_vmas(monkeypatch, mapped)
    spaces = myapp_alone()
    task = Task(1230, 1230, "myapp", False, "myapp", mm, 0)
    read = reader(Memory(), [])
    first = (await spaces.space_of(read, task, [0x40_1000])).find(0x40_1000)
    assert first is not None and first.name == "[anon]" and reads == [mm]
    mapped[:] = [replace(mapped[0], name="libc.so.6")]
    again = (await spaces.space_of(read, task, [0x40_1000])).find(0x40_1000)
    assert again is not None and again.name == "[libc.so.6]" and reads == [mm, mm]
    await spaces.space_of(read, task, [0x40_1000])
    assert reads == [mm, mm]  # named: trusted


async def test_a_module_without_orc_tables_is_unwound_by_its_code_read_from_memory(
    module_layout: ModuleLayout,
) -> None:
    # An arm64 module: no ORC fields in its struct module. A leaf function keeps no frame
    # record (its caller is in x30): only its code tells, so its text is read once.
    memory, text = Memory(), 0xFFFF_8000_7A10_0000
    module(memory, module_layout, ALPHA, "alpha", text)
    code = bytes(range(256)) * 32  # the 0x2000 bytes module() gives it
    memory.put(text, code)
    link(memory, module_layout, [ALPHA])
    layout = replace(module_layout, orc=None)
    (found,) = await ModuleList(reader(memory, []), HEAD, layout, None, AARCH64).refresh() or []
    analysis = [step for step in found.steps if isinstance(step, PrologueStep)]
    assert len(analysis) == 1 and analysis[0].code == code and analysis[0].code_addr == text


async def test_a_module_list_unreadable_at_attach_is_read_at_the_first_kernel_mode_sample(
    layout: TaskLayout, module_layout: ModuleLayout
) -> None:
    # arm64 under KPTI: with every vCPU in user mode at attach, no read sees the kernel. The
    # list is not taken as empty: the first sample of a vCPU in the kernel reads it.
    memory = guest(layout, (KWORKER, KWORKER))
    memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
    module(memory, module_layout, ALPHA, "alpha", 0xFFFF_FFFF_C010_0000)
    unreadable = Memory()
    modules = ModuleList(reader(unreadable, []), HEAD, module_layout, None, X86_64)
    assert await modules.refresh() is None and not modules.read_whole
    link(memory, module_layout, [ALPHA])
    modules.read = reader(memory, [])  # a vCPU in the kernel now
    identifier = make(layout, PER_CPU_OFFSET, module_list=modules)
    transport = FakeTransport({}, memory.frozen())
    found = await identifier.identify(transport, regs(0, KERNEL.start + 16), PageCache())
    module_found = found.space.find(0xFFFF_FFFF_C010_0010)
    assert modules.read_whole and module_found is not None and module_found.name == "[alpha]"


async def test_a_module_that_could_not_be_read_is_read_again(module_layout: ModuleLayout) -> None:
    # The list's links read, the struct module not (the vCPUs left the kernel between reads
    # of a running guest): not taken as a module that is not there for good.
    memory = Memory()
    link(memory, module_layout, [ALPHA])
    modules = ModuleList(reader(memory, []), HEAD, module_layout, None, X86_64)
    assert await modules.refresh() == [] and not modules.read_whole
    module(memory, module_layout, ALPHA, "alpha", 0xFFFF_FFFF_C010_0000)
    modules.read = reader(memory, [])
    assert [m.name for m in await modules.refresh() or []] == ["[alpha]"] and modules.read_whole


async def test_a_module_s_names_ending_near_the_end_of_their_mapping_are_read(
    module_layout: ModuleLayout,
) -> None:
    # 6.12's arm64 module: its string table a few bytes before an unmapped page, where a read
    # of the longest name past the last one's start fails.
    memory, text = Memory(), 0xFFFF_FFFF_C010_0000
    kallsyms, symtab = 0xFFFF_FFFF_C030_0000, 0xFFFF_FFFF_C030_0100
    strtab = 0xFFFF_FFFF_C040_0000 - 16
    module(memory, module_layout, ALPHA, "alpha", text)
    link(memory, module_layout, [ALPHA])
    memory.put(ALPHA + module_layout.kallsyms, struct.pack("<Q", kallsyms))
    memory.put(kallsyms + module_layout.symtab, struct.pack("<Q", symtab))
    memory.put(kallsyms + module_layout.num_symtab, struct.pack("<I", 1))
    memory.put(kallsyms + module_layout.strtab, struct.pack("<Q", strtab))
    memory.put(symtab, struct.pack("<IBBHQQ", 1, 2, 0, 1, text + 0x10, 0x20))  # STT_FUNC
    memory.put(strtab, b"\0qb_read\0".ljust(16, b"\0"))
    (found,) = (
        await ModuleList(reader(memory, []), HEAD, module_layout, None, X86_64).refresh() or []
    )
    assert found.symbols is not None and found.symbols.lookup(text + 0x18) == ("qb_read", 8)


async def test_a_module_whose_symbols_could_not_be_read_is_read_again(
    module_layout: ModuleLayout,
) -> None:
    memory, text, kallsyms = Memory(), 0xFFFF_FFFF_C010_0000, 0xFFFF_FFFF_C030_0000
    module(memory, module_layout, ALPHA, "alpha", text)
    link(memory, module_layout, [ALPHA])
    memory.put(ALPHA + module_layout.kallsyms, struct.pack("<Q", kallsyms))  # not mapped yet
    modules = ModuleList(reader(memory, []), HEAD, module_layout, None, X86_64)
    assert await modules.refresh() == [] and not modules.read_whole
    memory.put(kallsyms, bytes(64))  # mapped now: no symbols in it
    assert [m.name for m in await modules.refresh() or []] == ["[alpha]"] and modules.read_whole


async def test_the_vcpus_of_one_tick_all_take_the_module_list_read_late(
    layout: TaskLayout, module_layout: ModuleLayout
) -> None:
    # Both vCPUs' samples are identified together: the one that waits for the other's read
    # of the list must not go on without it (its module frames unplaced).
    memory = guest(layout, (KWORKER, KWORKER))
    memory.task(layout, KWORKER, 55, 55, "kworker/1:0", PF_KTHREAD, KWORKER)
    module(memory, module_layout, ALPHA, "alpha", 0xFFFF_FFFF_C010_0000)
    modules = ModuleList(reader(Memory(), []), HEAD, module_layout, None, X86_64)
    assert await modules.refresh() is None
    link(memory, module_layout, [ALPHA])
    read = reader(memory, [])

    async def slow(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        await asyncio.sleep(0)  # a read over the transport: the other vCPU's identify runs
        return await read(ranges)

    modules.read = slow
    identifier = make(layout, PER_CPU_OFFSET, module_list=modules)
    transport = FakeTransport({}, memory.frozen())
    both = await asyncio.gather(
        *(
            identifier.identify(transport, regs(cpu, KERNEL.start + 16), PageCache())
            for cpu in (0, 1)
        )
    )
    assert all(found.space.find(0xFFFF_FFFF_C010_0010) is not None for found in both)


async def test_an_exec_into_an_mm_at_the_old_one_s_address_is_placed_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exec frees the process's mm and takes a new one, which the slab may put at the same
    address: the same mm and tgid, another program (the leader's comm). Its space is read
    anew, not the old program's answered for a user address both map."""
    mapped = myapp_mapped(monkeypatch)
    spaces, task = myapp_spaces(UserFiles(None), None)
    read = reader(Memory(), [])
    assert (await spaces.space_of(read, task, [0x40_1000])).find(0x40_1000) is not None
    mapped[:] = [Vma(0x40_0000, 0x40_8000, 0, VM_EXEC, 0, "xz")]
    xz = replace(task, comm="xz", leader_comm="xz")
    found = (await spaces.space_of(read, xz, [0x40_1000])).find(0x40_1000)
    assert found is not None and found.name == "[xz]"  # its file not read: by name


async def test_preload_tries_again_while_no_vcpu_reads_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # arm64 7.x over QMP: attached while both vCPUs ran user code (KPTI: the kernel unmapped),
    # one read of __per_cpu_offset found nothing, and no user-mode sample named its process until
    # a kernel-mode one had read a base (test_aarch64_vs_gdb[7], 7 of its first 10 vCPU-moments).
    monkeypatch.setattr(current_module, "PRELOAD_PAUSE", 0.0)
    table = struct.pack("<2Q", *BASES)
    passes: list[int] = []

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        passes.append(len(ranges))
        if len(passes) < 3:  # the first two passes: every vCPU in user mode
            return [None] * len(ranges)
        return [table[a - PER_CPU_OFFSET : a - PER_CPU_OFFSET + n] for a, n in ranges]

    current = CurrentTask(CURRENT, PER_CPU_OFFSET, X86_64, lambda: 0.0, RECHECK)
    await current.preload(read, [0, 1])
    assert current.bases == {0: BASES[0], 1: BASES[1]} and len(passes) == 3
    never = CurrentTask(CURRENT, PER_CPU_OFFSET, X86_64, lambda: 0.0, RECHECK)
    passes.clear()

    async def nothing(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        passes.append(len(ranges))
        return [None] * len(ranges)

    await never.preload(nothing, [0, 1], tries=4)
    assert never.bases == {} and len(passes) == 4  # bounded: attach goes on without
