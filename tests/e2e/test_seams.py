"""The guest-OS, instruction-set and transport seams are real: a guest OS, an instruction set and
a transport written only in this file, registered through the registries, are what a run of the
real bundled guest uses, with no other file touched.

The instruction set is x86_64 under another name (QEMU runs x86), counting what the walker asks
of it; its register formats relabel QEMU's x86 registers as its own. The guest OS recognises
the bundled kernel by a symbol and calls every user-mode sample one process. The transport is
QMP under another name, counting the pauses and reads that go through it, with a window of its
own."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from guestvm import running_guest

from qmpprof import arch, session, transport
from qmpprof.arch.base import InstructionSet, PrologueRule, ReadWord
from qmpprof.arch.x86 import X86_64
from qmpprof.arch.x86regs import X86Formats
from qmpprof.errors import MemoryReadError
from qmpprof.guest import registry as guest
from qmpprof.guest.base import Attached, GuestOption, GuestSpec, Identity, KernelFile
from qmpprof.model import Mode, Process, Registers
from qmpprof.pagecache import PageCache
from qmpprof.sampler import SamplerConfig
from qmpprof.transport.base import Address, Forwarding, GuestTransport, Opened, Reach
from qmpprof.transport.qmp import QmpTransport
from qmpprof.unwind.space import AddressSpace, Module

pytestmark = pytest.mark.qemu


class ToyIsa:
    """x86_64's numbers under the name "toy64"; counts the walker's questions."""

    name = "toy64"
    address_size, pc, sp, fp, names = 8, X86_64.pc, X86_64.sp, X86_64.fp, X86_64.names
    elf_machine, kernel_boundary = X86_64.elf_machine, X86_64.kernel_boundary
    shared_from, space_register, mask = X86_64.shared_from, "toyroot", X86_64.mask
    frame_record = X86_64.frame_record

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()

    def return_address(self, value: int) -> int | None:
        self.asked["return_address"] += 1
        return X86_64.return_address(value)

    def trap_frame_sp(self, after_pc: int, read: ReadWord) -> int | None:
        self.asked["trap_frame_sp"] += 1
        return X86_64.trap_frame_sp(after_pc, read)

    def prologue(
        self,
        code: bytes,
        code_addr: int,
        pc: int,
        func_start: int | None,
        func_end: int | None = None,
    ) -> PrologueRule | None:
        self.asked["prologue"] += 1
        return X86_64.prologue(code, code_addr, pc, func_start)

    def prepare(self) -> None:
        X86_64.prepare()

    def same_code(self, file: bytes, running: bytes) -> bool:
        return X86_64.same_code(file, running)


class ToyFormats:
    """QEMU's x86 registers, as the toy's."""

    extra: tuple[str, ...] = ()

    def __init__(self, isa: ToyIsa) -> None:
        self.isa = isa

    def from_monitor(self, text: str) -> list[Registers]:
        return [self._ours(regs) for regs in X86Formats().from_monitor(text)]

    def from_gdb(
        self, cpu: int, payload: bytes, extra: Mapping[str, int] | None = None
    ) -> Registers:
        return self._ours(X86Formats().from_gdb(cpu, payload))

    def _ours(self, regs: Registers) -> Registers:
        return dataclasses.replace(regs, isa=self.isa.name) if regs.isa == "x86_64" else regs


class ToyGuest:
    """Every user-mode sample is process ``pid`` (its OS's option), "toy"; kernel ones the
    kernel's."""

    def __init__(self, isa: InstructionSet, kernel: Module, pid: int) -> None:
        self.arch = isa
        self.pid = pid
        self.space = AddressSpace([kernel])
        self.attached = self.housekept = 0

    async def attach(self, transport: GuestTransport) -> Attached:
        self.attached += 1
        assert transport.control is not None  # QMP, beside the private gdbstub
        return Attached(("toy: attached",))

    async def housekeep(self) -> None:
        self.housekept += 1

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        return ()

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        process = Process(self.pid, "toy", regs.space, space_name=self.arch.space_register)
        return Identity(process if regs.user else None, self.space)


class ToyOs:
    name = "toy"
    options = (GuestOption("toy_pid", "PID", "the toy's process id", kind="value", read=int),)

    def __init__(self) -> None:
        self.loaded: list[ToyGuest] = []

    def recognises(self, kernel: KernelFile | None) -> bool:
        return (
            kernel is not None
            and kernel.elf is not None
            and bool(kernel.elf.symbols.address_of("syscall_dispatch"))
        )

    def load(self, spec: GuestSpec) -> ToyGuest:
        assert spec.kernel is not None and spec.kernel.elf is not None and spec.auto
        image = spec.kernel.elf.prepare()
        pid = spec.options["toy_pid"]
        assert isinstance(pid, int)
        self.loaded.append(ToyGuest(spec.arch, Module.from_image(image, kernel=True), pid))
        return self.loaded[-1]


class ToyTransport(Forwarding):
    """QMP's, counting the stops and the reads of the sampler's stack windows."""

    def __init__(self, inner: QmpTransport) -> None:
        super().__init__(inner)
        self.asked: Counter[str] = Counter()

    async def stop(self) -> None:
        self.asked["stop"] += 1
        await super().stop()

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        self.asked["read_many"] += 1
        return await super().read_many(cpu, ranges)


class ToyKind:
    """``--transport toy``: QMP at the local socket, a window of one page."""

    name = "toy"
    needs = frozenset({Address.QMP_SOCKET})
    WINDOW = 4096

    def __init__(self) -> None:
        self.opened: list[ToyTransport] = []

    async def open(self, reach: Reach, passed_over: str | None) -> Opened:
        self.opened.append(ToyTransport(await QmpTransport.connect(reach.qmp_socket)))
        return Opened(self.opened[-1], "the toy", window=self.WINDOW)


@dataclasses.dataclass
class Toys:
    isa: ToyIsa
    os: ToyOs
    transport: ToyKind


@pytest.fixture
def toys() -> Iterator[Toys]:
    made = Toys(ToyIsa(), ToyOs(), ToyKind())
    arch.register(made.isa, ToyFormats(made.isa), ("x86_64",))
    guest.register(made.os, first=True)
    transport.register(made.transport, first=True)
    try:
        yield made
    finally:
        arch.unregister(made.isa)
        guest.unregister(made.os.name)
        transport.unregister(made.transport.name)


async def test_a_run_uses_the_guest_os_instruction_set_and_transport_registered_here(
    tmp_path: Path, toys: Toys
) -> None:
    isa, kind = toys.isa, toys.os
    paths: list[str] = []
    with running_guest(tmp_path) as booted:
        spec = session.RunSpec(
            reach=Reach(booted.qmp_socket),
            kernel=booted.kernel_elf,
            os_options=(("toy_pid", 7),),  # the toy OS's own option, passed through untouched
            sampling=SamplerConfig(interval=0.01, duration=1.0),
        )
        run = await session.start(spec, on_connect=lambda connection: paths.append(connection.path))
        try:
            await run.run()
        finally:
            await run.transport.close()
        witness = await QmpTransport.connect(booted.qmp_socket)
        try:
            assert await witness.status() == "running"  # left as found
        finally:
            await witness.close()
    # Through the toy transport, the one auto took (first in the registry), its window kept.
    (opened,) = toys.transport.opened
    assert run.transport is opened and paths == ["the toy"]
    assert run.config.window == ToyKind.WINDOW < spec.sampling.window
    assert opened.asked["stop"] >= run.stats.ticks > 0 and opened.asked["read_many"] > 0
    (toy,) = kind.loaded
    assert toy.attached == 1 and toy.housekept > 0
    assert run.unwinder.arch is isa  # type: ignore[attr-defined]
    assert isa.asked["return_address"] > 0
    profile = run.profile
    assert len(profile) >= 50
    users = [r for r in profile.stacks if r.mode is Mode.USER]
    kernels = [r for r in profile.stacks if r.mode is Mode.KERNEL]
    assert users and kernels
    assert {r.process.label for r in users if r.process} == {"toy (pid 7)"}
    assert all(r.process is None for r in kernels)
    # Walked and named through the toy: the kernel's frames by the kernel ELF's symbols.
    assert all(profile.frames_of(r) and profile.frames_of(r)[0].symbol for r in kernels)
    assert arch.by_elf(*X86_64.elf_machine) is isa and guest.choose("auto", None).name != "toy"


def test_unregistered_they_are_gone(toys: Toys) -> None:
    isa, kind = toys.isa, toys.os
    assert guest.names()[:2] == ["auto", "toy"] and arch.formats("x86_64") is not None
    assert transport.names()[:2] == ["auto", "toy"]
    assert transport.choose(Reach())[0] is toys.transport
    arch.unregister(isa)
    guest.unregister(kind.name)
    transport.unregister(toys.transport.name)
    assert arch.by_elf(*X86_64.elf_machine) is X86_64 and "toy" not in guest.names()
    assert isinstance(arch.formats("x86_64"), X86Formats)
    assert "toy" not in transport.names() and transport.choose(Reach())[0].name == "private-gdb"
