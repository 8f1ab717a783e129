"""A guest OS told by its kernel description (``--describe FILE``, ``--os described``): pids and
names read in the pause through the description's expressions, the rest (user programs by their
code under the page-table root, the firmware, the kernel file's check) as ``cr3.py`` does.

A pause reads the description's fixed words (the current-task pointer of ``cpus[$cpu]``) with
the stack, in the same request (``reads_for``), and there too the fields (the span of its bytes
the keys read) of the task the vCPU ran at its last sample; a task that is not that one has its
fields read in one more request; then whatever else an expression needs, one read each. An
expression that reads unmapped memory leaves that sample with no pid (named by its address
space, as without a description); the run goes on and ends with one warning line. A task's
``root`` (as the kernel keeps it) is its process's space; without one, the vCPU's register's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qmpprof.elf.dwarftypes import DwarfTypes
from qmpprof.errors import DescribeError, UsageError
from qmpprof.guest.base import Attached, FoundTask, GuestOption, GuestSpec, Identity, KernelFile
from qmpprof.guest.cr3 import Cr3Identifier, load_files
from qmpprof.guest.describe import description
from qmpprof.guest.describe.compile import Env, Unreadable
from qmpprof.guest.describe.description import Description
from qmpprof.guest.describe.lister import Fetched, SwitchedTasks, settled
from qmpprof.memory import fetch_piece, reader
from qmpprof.model import Process, Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport

# Reads one evaluation may make one after the other (each a pointer followed): more is a
# description that walks a list, which these keys do not.
MAX_ROUNDS = 16


class DescribedOs:
    """``--os described``; ``auto`` takes it whenever ``--describe`` is given."""

    name = "described"
    options = (
        GuestOption(
            "describe",
            "FILE",
            "a kernel description (TOML: C expressions over the kernel's DWARF globals that say"
            " each vCPU's current task, its pid and name; docs/describe.md)",
            chooses=True,
        ),
    )

    def recognises(self, kernel: KernelFile | None) -> bool:
        return False  # only by --describe (registry.choose)

    def load(self, spec: GuestSpec) -> DescribedIdentifier:
        path = spec.path("describe")
        if path is None:
            raise UsageError("--os described needs --describe FILE")
        modules, programs, image = load_files(spec)
        if image is None:
            raise UsageError("--describe needs --kernel: the kernel's DWARF types its expressions")
        types = DwarfTypes(image)
        if not types.has_dwarf:
            raise DescribeError(
                f"{path}: {image.name} has no DWARF (.debug_info): build it with -g"
            )
        described = description.load(path, types, spec.arch)
        by_cr3 = Cr3Identifier(modules, programs, spec.arch, kernel_file=image)
        return DescribedIdentifier(by_cr3, described)


class _NoMemory:
    def read(self, addr: int, size: int) -> bytes | None:
        raise AssertionError("a fixed read reads no memory")


class DescribedIdentifier:
    """A Guest by its description, beside ``Cr3Identifier`` (programs, firmware, checks)."""

    def __init__(self, by_cr3: Cr3Identifier, described: Description) -> None:
        self.by_cr3 = by_cr3
        self.description = described
        self.arch = by_cr3.arch
        self.unreadable = 0  # samples an expression left without a pid
        self._last_task: dict[int, int] = {}  # vCPU -> the task it ran at its last sample
        self.first_unreadable: Unreadable | None = None
        keys, space = described.tasks, by_cr3.kernel.space
        self.switched = None if keys is None else SwitchedTasks(described, keys, space, self.arch)

    async def every_task(self, transport: GuestTransport) -> list[FoundTask]:
        """Every task switched out (--off-cpu), as the description's task keys tell them."""
        if self.switched is None:
            raise UsageError(
                f"--off-cpu: {self.description.path.name} says no 'tasks' (docs/describe.md)"
            )
        return await self.switched.every_task(transport)

    async def versions(
        self, transport: GuestTransport, tasks: Sequence[FoundTask]
    ) -> list[tuple[int, ...] | None]:
        assert self.switched is not None  # every_task came first
        return await self.switched.versions(transport, tasks)

    async def attach(self, transport: GuestTransport) -> Attached:
        attached = await self.by_cr3.attach(transport)
        said = f"tasks as {self.description.path.name} describes them"
        return Attached((*attached.detail, said), attached.notes)

    async def housekeep(self) -> None:
        return None

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        if self.by_cr3.firmware.runs(regs):
            return ()
        env = Env(regs.cpu, regs, _NoMemory())
        reads = [(code(env), size) for code, size in self.description.fixed_reads]
        task, span = self._last_task.get(regs.cpu), self.description.task_span
        if task is not None and span is not None:
            reads.append((task + span[0], span[1] - span[0]))
        return reads

    async def identify(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> Identity:
        base = await self.by_cr3.identify(transport, regs, cache)
        if self.by_cr3.firmware.runs(regs):
            return base
        read, env = reader(transport, regs.cpu), Env(regs.cpu, regs, Fetched(cache))
        try:
            task = await settled(
                lambda: self.description.current_task(env), read, cache, MAX_ROUNDS
            )
            if task is None:
                return base if regs.user else self.by_cr3.kernel  # idle, or the kernel alone
            self._last_task[regs.cpu] = task
            span = self.description.task_span
            if span is not None:
                await fetch_piece(read, cache, task + span[0], span[1] - span[0])
            found = await settled(
                lambda: self.description.about(env, task), read, cache, MAX_ROUNDS
            )
        except Unreadable as err:
            self.unreadable += 1
            self.first_unreadable = self.first_unreadable or err
            return base
        if found.root is None:
            process = Process(
                found.pid, found.name, regs.space, space_name=self.arch.space_register
            )
        else:
            process = Process(found.pid, found.name, found.root, space_name="root")
        return dataclasses.replace(base, process=process)

    def warnings(self) -> list[str]:
        """The run's lines on what the description could not read (samples, --off-cpu tasks)."""
        first = self.first_unreadable
        lines: list[str] = []
        if self.switched is not None and self.switched.first_unreadable is not None:
            off = self.switched.first_unreadable
            lines.append(
                f"Warning: {self.description.path.name}: '{off.key}' could not be read for"
                f" --off-cpu, tasks left out (first: {off.what})"
            )
        if first is None:
            return lines
        return [
            f"Warning: {self.description.path.name}: '{first.key}' could not be read in"
            f" {self.unreadable} samples, which have no pid (first: {first.what})",
            *lines,
        ]
