"""The guest-OS seam: one Protocol for a guest OS's whole life in a run.

A kind of guest OS (``GuestOs``, one per ``--os`` name in the registry, ``qmpprof.guest``) says
whether it recognises a kernel file (``--os auto`` asks each in turn) and loads what it needs
before the guest is touched (``load``: files read and indexed, a bad one fails first). What it
loads is a ``Guest``: it ``attach``es to the running guest (where the kernel was loaded, its
modules, its tasks: through the transport's control channel, while the guest runs), keeps up
with slow changes between ticks (``housekeep``, while the guest runs), and tells who runs on a
vCPU at each sample (``reads_for`` before the stack is read: those ranges go out in the same
round trip; ``identify`` while the guest is stopped, reading through the sample's page cache and
the transport). Implementations: the Linux package (``linux/``), the Emerald metadata page
(``emerald.py``), page-table roots alone (``cr3.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, TypeVar, runtime_checkable

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.image import ElfImage
from qmpprof.errors import ElfError, KernelImageError
from qmpprof.memory import Reader
from qmpprof.model import Process, Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.space import AddressSpace

Space_co = TypeVar("Space_co", covariant=True)
PAGE = 4096  # the smallest page of every instruction set qmpprof reads
_HEAD = 0x300  # bytes of a kernel file looked at to recognise it (a bzImage's header is below)


@dataclass(frozen=True, slots=True, eq=False)
class KernelFile:
    """The kernel file of a run, opened once: its first bytes, and its ELF (mapped) and
    instruction set when it is an ELF of one qmpprof reads."""

    path: Path
    head: bytes
    elf: ElfImage | None = None

    @classmethod
    def open(cls, path: Path) -> KernelFile:
        """Raises ElfError (one line) for a file that cannot be read, or an ELF qmpprof cannot
        read; another file is kept by its head for the guest OSes to recognise. A folder that
        holds one kernel image under its plain name (``/usr/lib/modules/RELEASE/``, where
        distributions now put ``vmlinuz``) stands for that image."""
        if path.is_dir():
            path = _image_in(path)
        try:
            with open(path, "rb") as f:
                head = f.read(_HEAD)
        except OSError as err:
            raise ElfError(str(path), err.strerror or str(err)) from err
        elf = ElfImage.load(path, mapped=True) if head.startswith(b"\x7fELF") else None
        return cls(path, head, elf)

    @property
    def arch(self) -> InstructionSet | None:
        return None if self.elf is None else self.elf.arch

    def kernel_boundary(self, default: int) -> int:
        """The lowest kernel address as the kernel's ELF says it: the page of its lowest
        segment when the kernel is linked below ``default`` (the instruction set's split) at
        an offset from where it loads (a kernel at 0x80100000 loaded at 1 MiB), else
        ``default``. An identity-mapped kernel (linked where it loads) says nothing of where
        user space begins, so it keeps ``default``."""
        if self.elf is None or not self.elf.physical_ranges:
            return default
        low = self.elf.load_range[0]
        linked_at_offset = low != min(start for start, _ in self.elf.physical_ranges)
        return low & ~(PAGE - 1) if linked_at_offset and low < default else default


IMAGE_NAMES = ("vmlinuz", "vmlinux", "bzImage")  # a kernel image's plain names in a folder


def _image_in(folder: Path) -> Path:
    """The kernel image a folder holds under a plain name; ElfError naming what it has else."""
    found = [folder / name for name in IMAGE_NAMES if (folder / name).is_file()]
    if len(found) == 1:
        return found[0]
    names = found or sorted(folder.glob("vmlinu[xz]-*"))
    which = ", ".join(p.name for p in names[:4]) + (", ..." if len(names) > 4 else "")
    if names:
        raise KernelImageError(str(folder), f"a folder: name one of its images ({which})")
    raise KernelImageError(str(folder), f"a folder with none of {', '.join(IMAGE_NAMES)}")


@dataclass(frozen=True, slots=True)
class GuestOption:
    """A setting a guest OS takes, declared by the OS (``GuestOs.options``): the flag ``--KEY``
    (dashes for underscores) of the profiling command and of serve, and ``KEY`` in serve's
    TOML files; cli, session and serve pass its value through by key. ``kind``: a file's or a
    folder's path (there before the guest is touched; in a TOML file, from that file's folder),
    or a value ``read`` from its text (ValueError: what it should be). ``chooses``: given, it
    makes ``--os auto`` this OS, and another ``--os`` refuses it. ``symbols``: it names the
    kernel's symbols, so a run with it and no ``--kernel`` still names kernel code.
    ``booted``: the file of ``transport.BootFiles`` (``initrd``) it takes when not given and
    whoever runs the VM names one (a libvirt domain's XML)."""

    key: str
    metavar: str
    help: str
    kind: Literal["file", "folder", "value"] = "file"
    read: Callable[[str], object] | None = None
    chooses: bool = False
    symbols: bool = False
    booted: Literal["initrd"] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def value(self, text: str, folder: Path | None = None) -> object:
        """``text`` as this option's value (a path from ``folder``, when given and the path is
        relative); ValueError naming what it should be."""
        if self.kind != "value":
            return Path(text) if folder is None else folder / text
        return text if self.read is None else self.read(text)


@dataclass(frozen=True, slots=True)
class GuestSpec:
    """What a guest OS is told of a run. ``options``: the values of the guest OSes' options
    given (``GuestOption``), by key, each OS reading its own."""

    arch: InstructionSet  # the run's: the kernel file's, else the registry's default
    kernel: KernelFile | None = None
    user_dir: Path | None = None
    lines: bool = False  # resolve source lines and inlined frames where DWARF has them
    auto: bool = False  # chosen by --os auto, not named: fall back where the guest says nothing
    options: dict[str, object] = field(default_factory=dict)

    def path(self, key: str) -> Path | None:
        """The path option ``key``'s value, None when not given."""
        value = self.options.get(key)
        return value if isinstance(value, Path) else None


@dataclass(frozen=True, slots=True)
class Attached:
    """What attaching learnt, for the user: lines for ``--verbose`` (``detail``) and lines to
    tell in any case (``notes``: what the guest lacks, say)."""

    detail: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


class Identified(Protocol[Space_co]):
    """Who was running on a vCPU: the process (None for the kernel itself) and the address
    space (modules, unwinding steps, symbols) to unwind and name its stack with."""

    @property
    def process(self) -> Process | None: ...

    @property
    def space(self) -> Space_co: ...

    @property
    def memory(self) -> Reader | None:
        """Reads of the sample's memory when the vCPU's page tables are not the process's (a
        context switch caught between loading the next process's tables and switching
        stacks): its user half through the process's own; None: as the vCPU sees it."""
        ...

    @property
    def registers(self) -> Registers | None:
        """The registers to walk with, when the guest OS read more than the sample's."""
        ...

    @property
    def reread_mappings(self) -> RereadMappings[Space_co] | None:
        """Asked, in the pause, with the user addresses a walk in ``space`` found no code at:
        the identity with the process's space read again (a library mapped since), or None
        when there is nothing new to read; None: never asked."""
        ...

    @property
    def complete(self) -> Complete[Space_co] | None:
        """Asked once after cont when the pause placed the process's code in files it had not
        read yet (a program started since the run began): the identity with them read, to
        walk the pause's memory again in (None: nothing better); None: never asked."""
        ...


RereadMappings = Callable[[Sequence[int]], Awaitable[Identified[Space_co] | None]]
Complete = Callable[[], Awaitable[Identified[Space_co] | None]]


@dataclass(frozen=True, slots=True)
class Identity:
    """What the guest OSes of this package answer. ``registers``: the vCPU's registers with
    what the guest OS read beside them for the walk (arm64 Linux: the exception link register
    of a sample taken at an exception's entry); None: the walk takes them as sampled."""

    process: Process | None
    space: AddressSpace
    memory: Reader | None = None
    registers: Registers | None = None
    reread_mappings: RereadMappings[AddressSpace] | None = None
    complete: Complete[AddressSpace] | None = None


class GuestIdentifier(Protocol[Space_co]):
    """Tells who runs on a vCPU; everything learnt is cached across samples. Generic in the
    address space so that unit tests can give the sampler spaces of their own."""

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        """(address, size) ranges ``identify`` will need for this sample, read together with
        the stack window."""
        ...

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identified[Space_co]: ...


class Guest(GuestIdentifier[AddressSpace], Protocol):
    """A guest OS as a run knows it, once loaded."""

    @property
    def arch(self) -> InstructionSet:
        """The instruction set of the guest's kernel: the run's walker walks it."""
        ...

    async def attach(self, transport: GuestTransport) -> Attached:
        """Before the first sample, while the guest runs: learn what the running guest holds
        (through ``transport.control``, which reads without a stop)."""
        ...

    async def housekeep(self) -> None:
        """Between ticks, while the guest runs: keep up with slow changes (its own schedule).
        It runs beside the sampler's wait for the next tick and may still be waiting on the
        control channel when a pause begins: what it changes must be whole at each await."""
        ...


@dataclass(frozen=True, slots=True)
class FoundTask:
    """A task as a stopped guest holds it (``TaskLister``): who it is, its state (letter and
    name, as the guest's kernel reports it), the vCPU it runs on (None: off CPU); off CPU,
    where its kernel stack resumes (``kernel``) and the user registers it entered the kernel
    with (``user``, None for a kernel thread), the space to walk them in and how to read its
    memory (``read``: kernel and user addresses, the latter through its own page tables), and
    the stack bytes read already (``window``: address, bytes). ``at`` tells the task apart
    from the others (its address); ``version`` changes whenever it runs (its state and
    context-switch counts): equal before and after a walk, the task stood still meanwhile."""

    process: Process | None
    state: str
    state_name: str
    cpu: int | None
    space: AddressSpace
    kernel: Registers | None = None
    user: Registers | None = None
    read: Reader | None = None
    window: tuple[int, bytes] | None = None
    at: int = 0
    version: tuple[int, ...] = ()


@runtime_checkable
class TaskLister(Protocol):
    """A guest OS that can tell every task of the guest, on a CPU or waiting."""

    async def every_task(self, transport: GuestTransport) -> Sequence[FoundTask]:
        """After ``attach``: every task, read through ``transport`` (the guest stopped; or
        running, then each task is checked by ``versions``). Raises UsageError when this
        guest cannot tell its tasks."""
        ...

    async def versions(
        self, transport: GuestTransport, tasks: Sequence[FoundTask]
    ) -> list[tuple[int, ...] | None]:
        """Each task's ``version`` as it stands now, None for one on a CPU now."""
        ...


@runtime_checkable
class Warns(Protocol):
    """A guest OS with something to tell at the end of a run (what it could not read)."""

    def warnings(self) -> list[str]:
        """One line each, said once for the run."""
        ...


class GuestOs(Protocol):
    """A kind of guest OS: one registry entry, chosen by ``--os NAME``, with the settings it
    takes (``options``)."""

    @property
    def name(self) -> str: ...

    @property
    def options(self) -> Sequence[GuestOption]: ...

    def recognises(self, kernel: KernelFile | None) -> bool:
        """Whether ``--os auto`` takes this OS for a run with this kernel file (or none)."""
        ...

    def load(self, spec: GuestSpec) -> Guest:
        """Read and index what the run needs before the guest is touched; errors raise with
        one line (a QmpprofError)."""
        ...


def kernel_image(spec: GuestSpec) -> ElfImage | None:
    """The kernel ELF of a run (read and indexed), None without one; ElfError (one line) for a
    kernel file that is no ELF qmpprof reads."""
    if spec.kernel is None:
        return None
    image = spec.kernel.elf or ElfImage.load(spec.kernel.path)
    return image.prepare()
