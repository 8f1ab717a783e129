"""Processes told apart by their page-table root (CR3) alone: for guests that say nothing else.

A CR3 never seen in user mode belongs to the kernel (idle, kernel threads, boot), unless one of
``--user-dir``'s programs is found under it: a process first caught inside a system call is
still that process. A user address space's program is found by reading, under that CR3, the
``.text`` range of each ELF of ``--user-dir`` and comparing its bytes; without a match its user
stack is walked with frame pointers and it is named by its CR3.

Before any of that, a sample of the machine's firmware is told apart (``firmware.py``), and the
kernel file is checked against the running kernel (``kernelcheck.py``) at attach, or at the
first sample that shows a kernel when no vCPU did then.
"""

from __future__ import annotations

from collections.abc import Sequence

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.image import ElfImage
from qmpprof.elf.trapframe import trap_frame_layout
from qmpprof.guest.base import Attached, GuestSpec, Identity, KernelFile, kernel_image
from qmpprof.guest.firmware import Firmware
from qmpprof.guest.kernelcheck import KernelCheck
from qmpprof.guest.programs import ProgramIndex
from qmpprof.memo import Memo
from qmpprof.memory import read_one, reader
from qmpprof.model import Process, Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import AddressSpace, Module


class Cr3Os:
    """``--os cr3``; ``auto`` takes it when no other guest OS recognises the kernel file."""

    name = "cr3"
    options = ()

    def recognises(self, kernel: KernelFile | None) -> bool:
        return True

    def load(self, spec: GuestSpec) -> Cr3Identifier:
        modules, programs, image = load_files(spec)
        return Cr3Identifier(modules, programs, spec.arch, kernel_file=image)


def load_files(spec: GuestSpec) -> tuple[list[Module], ProgramIndex, ElfImage | None]:
    """The kernel ELF's module and the programs of ``--user-dir``, read and indexed, and the
    kernel ELF (None without one)."""
    image = kernel_image(spec)
    modules = (
        []
        if image is None
        else [Module.from_image(image, kernel=True, trap=trap_frame_layout(image))]
    )
    programs = ProgramIndex.from_dir(spec.user_dir) if spec.user_dir else ProgramIndex([])
    for program in programs.images:
        program.prepare()
    return modules, programs, image


class Cr3Identifier:
    """A Guest by page-table root; also the fallback of guest OSes that know more.
    ``kernel_file``: the kernel ELF the firmware is told from, and checked against the guest."""

    def __init__(
        self,
        kernel_modules: Sequence[Module],
        programs: ProgramIndex,
        arch: InstructionSet,
        *,
        kernel_file: ElfImage | None = None,
    ) -> None:
        self.kernel_modules = tuple(kernel_modules)
        self.programs = programs
        self.arch = arch
        self.firmware = Firmware.of(kernel_file, arch)
        self.check = None if kernel_file is None else KernelCheck(kernel_file, arch)
        self.kernel = Identity(None, AddressSpace(self.kernel_modules))
        self._by_cr3: Memo[int, Identity] = Memo(4096)
        self._user_cr3s: set[int] = set()
        self._kernel_cr3s: set[int] = set()  # seen only in kernel mode, and no program there

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        return ()

    async def attach(self, transport: GuestTransport) -> Attached:
        """The kernel file checked while the guest runs, when a vCPU shows a kernel."""
        if self.check is None:
            return Attached()
        if transport.control is not None:
            await self.check.attach(transport.control)
        if self.check.done:
            return Attached(("the kernel file's code is the guest's",))
        return Attached(("the kernel file is checked at the first sample that shows a kernel",))

    async def housekeep(self) -> None:
        return None

    async def guard(self, transport: GuestTransport, regs: Registers) -> Identity | None:
        """A firmware sample's identity; else None, once the kernel file was checked if this
        sample is the first to show kernel code (KernelMismatchError: it is not the guest's)."""
        if self.firmware.runs(regs):
            return self.firmware.identity(regs)
        if self.check is not None:
            await self.check.in_pause(transport, regs)
        return None

    def note(self, regs: Registers) -> None:
        """Remember that this address space runs user code (call for every sample)."""
        if regs.user:
            self._user_cr3s.add(regs.space)

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        guarded = await self.guard(transport, regs)
        if guarded is not None:
            return guarded
        self.note(regs)
        found = self._by_cr3.get(regs.space)
        if found is not None:
            return found
        if regs.space not in self._user_cr3s:
            if regs.space in self._kernel_cr3s or not self.programs.images:
                return self.kernel
            found = await self._from_cr3(transport, regs)
            if found.process is None or found.process.program is None:
                self._kernel_cr3s.add(regs.space)
                return self.kernel
        else:
            found = await self._from_cr3(transport, regs)
        return self._by_cr3.put(regs.space, found)

    async def _from_cr3(self, transport: GuestTransport, regs: Registers) -> Identity:
        read = reader(transport, regs.cpu)
        name = self.arch.space_register
        for image in self.programs.images:
            text = await read_one(read, image.text_addr, image.text_size)
            if text is not None and self.programs.match(text) is image:
                module = Module.from_image(image, kernel=False)
                return self.with_module(
                    Process(None, image.name, regs.space, space_name=name), module
                )
        return Identity(Process(None, None, regs.space, space_name=name), self.kernel.space)

    def with_module(self, process: Process, user: Module) -> Identity:
        """The identity of a process whose user code is ``user``, beside the kernel's modules."""
        return Identity(process, AddressSpace([*self.kernel_modules, user]))
