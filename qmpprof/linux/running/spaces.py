"""Linux processes' address spaces: the kernel's modules and each process's executable mappings
(``vma.py``), its programs and libraries found in ``--user-dir`` and placed at their load bias,
trusted for ``RECHECK`` seconds per address space and confirmed between samples.

Placing a mapping compares a few bytes of its code with the file that claims it, read through
the process's own page tables: inside a pause through the vCPU that runs it, before the first
stop and between samples through ``PageTables`` (``pagetables.py``), which walks them in kernel
memory while the guest runs. No file is read inside a pause: a process first met there with a
file not read yet (one that started during the run) is placed without it (its code known by
the mapping's name alone), and between samples the file is read and the process placed again
(``settle``): a new process costs its first pause a few reads of its mappings, never a file.
A process that has just started maps its libraries one after the other: a sample whose user pc
or return address no mapping read covers (in kernel mode too: a walk's user part, asked after
the walk) has them read again, once per page of code they lack.

A process of many mappings (over ``PAUSE_VMAS``: a JVM's, a database's, up to 65,530) is never
walked whole inside a pause: a pause looks up in its tree only the mappings that hold the
sample's user addresses (``find_exec_vmas``) and adds them to those known; the whole walk is
done between samples (``confirm``, first for a space placed so in part).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.guest.userfiles import UserFiles
from qmpprof.linux.running.pagetables import PageTables, user_end
from qmpprof.linux.running.tasks import LIMIT, Task
from qmpprof.linux.running.vma import Vma, VmaLayout, VmaWalk, find_exec_vmas, read_exec_vmas
from qmpprof.memo import Memo
from qmpprof.memory import Reader, read_ints
from qmpprof.model import Mapping
from qmpprof.pagecache import PAGE
from qmpprof.unwind.space import AddressSpace, Module

RECHECK = 5.0  # seconds a process's mappings are trusted without reading them again
CONFIRM_EVERY = 0.5  # seconds between two confirmations of a process's mappings
_PROBE = 32  # bytes of code compared between a mapping and the file that claims it
PAUSE_VMAS = 1000  # mappings a pause may walk whole (a shell has a few dozen)


Key = tuple[int, int, str]  # mm, tgid, the thread group leader's comm


def _key(task: Task) -> Key:
    return (task.mm, task.tgid, task.leader_comm)


@dataclass(frozen=True, slots=True)
class Placed:
    """A process's address space as built from its mappings (``vmas``), read or confirmed
    unchanged at ``checked``."""

    space: AddressSpace
    checked: float
    vmas: tuple[Vma, ...]
    waiting: bool = False  # placed without files that were not read yet
    lacking: frozenset[int] = frozenset()  # pages of user pcs the mappings lacked when read
    pgd: int | None = None  # mm_struct.pgd: its top-level page table (None: not read)
    partial: bool = False  # only the mappings a pause looked up: the whole read between samples


class Spaces:
    """Each process's address space by (mm, tgid, the leader's comm: an exec that frees an mm
    and takes a new one at the same address, the slab's reuse, still changes the key by the
    program's name: 29-31 samples of Debian's xz walked as the busybox it was exec'd from, in
    the churn test on 6.1, before it counted); ``kernel``: the kernel's space (its
    modules), which a kernel thread uses and every process's space starts from."""

    def __init__(
        self,
        kernel: AddressSpace,
        vmas: VmaLayout | None,
        files: UserFiles,
        tables: PageTables | None,
        clock: Callable[[], float],
        end: int | None = None,
        arch: InstructionSet | None = None,
    ) -> None:
        """``tables``: the page tables, walked in kernel memory (None: not walked; then user
        space ends at ``end``, or where four levels of x86_64 tables put it); ``arch``: the
        walker's instruction set, under the guest's translation settings (``translated``),
        which user code is walked in too (aarch64: its return addresses signed)."""
        self.vmas = vmas
        self.arch = arch
        self.files = files
        self.tables = tables
        if tables is not None:
            self.user_end = tables.user_end
        else:
            self.user_end = user_end(4) if end is None else end
        self.clock = clock
        self._confirmed = clock()
        self.start_over(kernel)

    def start_over(self, kernel: AddressSpace) -> None:
        """The kernel's modules changed (or none were known): every process's space is built
        again."""
        self.kernel = kernel
        self.gone = AddressSpace(kernel.modules, user_gone=True)
        self._placed: Memo[Key, Placed] = Memo(LIMIT)
        self._used: Memo[Key, float] = Memo(LIMIT)  # when a sample last did
        self._walk: tuple[Key, Placed, VmaWalk] | None = None  # confirm's, under way

    async def space_of(self, read: Reader, task: Task, pcs: Sequence[int] = ()) -> AddressSpace:
        """The space of ``task``'s process, its mappings read through ``read`` (memory as the
        task's own vCPU sees it) when they were not read within RECHECK seconds, or when none
        of them holds one of the user addresses ``pcs`` (its user-mode pc, a walk's return
        addresses: a library mapped since) on a page not already found lacking. A process's
        task with no ``mm`` has released its user space (``exit_mm``): its space says so."""
        if self.vmas is not None and not task.mm and not task.kernel_thread and task.pid:
            return self.gone
        if self.vmas is None or not task.mm:
            return self.kernel
        key = _key(task)
        now = self.clock()
        self._used.put(key, now)
        seen = self._placed.get(key)
        if seen is not None and now - seen.checked <= RECHECK and _holds(seen, pcs):
            return seen.space
        many = await self._many(read, task.mm)
        if many and seen is not None and _holds(seen, pcs):
            return seen.space  # trusted past RECHECK: ``confirm`` reads it between samples
        if many:
            found = await find_exec_vmas(read, task.mm, self.vmas, self.user_end, pcs)
            spans = {(v.start, v.end) for v in found}  # read now: a name lacking before, say
            before = () if seen is None else [v for v in seen.vmas if (v.start, v.end) not in spans]
            vmas = tuple(sorted({*before, *found}, key=lambda v: v.start))
        else:
            vmas = tuple(await read_exec_vmas(read, task.mm, self.vmas, self.user_end))
        # The same mappings: the same mm (a changed set may be a later exec's, at its address).
        same = seen is not None and (many or seen.vmas == vmas)
        pgd = seen.pgd if seen is not None and same else None
        if pgd is None:
            pgd = await self._pgd(read, task.mm)
        space = await self._place(key, vmas, read, load=False, pgd=pgd, partial=many)
        lacking = {pc >> 12 for pc in pcs if space.find(pc) is None}
        if lacking:  # not mapped as code: not read again for these pages
            known = seen.lacking if seen is not None and same else frozenset()
            placed = self._placed[key]
            self._placed[key] = dataclasses.replace(placed, lacking=known | lacking)
        return space

    async def _many(self, read: Reader, mm: int) -> bool:
        """Whether the address space ``mm`` holds too many mappings to walk in a pause."""
        assert self.vmas is not None
        (count,) = await read_ints(read, [(mm + self.vmas.map_count, 4)])
        return count is not None and count > PAUSE_VMAS  # an absurd count too

    def holds(self, task: Task, pcs: Sequence[int]) -> bool:
        """Whether ``task``'s process's space as placed answers for the user addresses
        ``pcs`` (each in a mapping, or on a page found lacking when they were read)."""
        seen = self._placed.get(_key(task)) if task.mm else None
        return seen is None or _holds(seen, pcs)

    async def preload(self, read: Reader, task: Task) -> AddressSpace | None:
        """Before the first stop, through ``read`` (kernel memory, while the guest runs): the
        space of ``task``'s process, its code read through its own page tables; its ELF files
        are loaded in any case. None: it cannot be placed before a sample of it (one of many
        mappings is not walked here either: its first sample looks them up, ``confirm`` walks
        them in steps)."""
        if self.vmas is None or not task.mm:
            return self.kernel
        key = _key(task)
        placed = self._placed.get(key)
        if placed is not None:
            return placed.space
        if await self._many(read, task.mm):
            return None
        vmas = tuple(await read_exec_vmas(read, task.mm, self.vmas, self.user_end))
        for vma in vmas:
            if vma.name:
                self.files.candidates(vma.name)  # read and indexed now, not in a pause
        return await self._place_through_tables(read, key, vmas)

    async def _place_through_tables(
        self, read: Reader, key: Key, vmas: tuple[Vma, ...], *, partial: bool = False
    ) -> AddressSpace | None:
        """Place a process between samples: its code through its own page tables."""
        if self.tables is None or self.vmas is None:
            return None
        pgd = await self._pgd(read, key[0])
        if pgd is None:
            return None
        return await self._place(key, vmas, self.tables.reader(pgd), pgd=pgd, partial=partial)

    async def _pgd(self, read: Reader, mm: int) -> int | None:
        assert self.vmas is not None
        (pgd,) = await read_ints(read, [(mm + self.vmas.pgd, 8)])
        return pgd

    def pgd_of(self, task: Task) -> int | None:
        """The top-level page table of ``task``'s process as its space was placed with (None:
        not known)."""
        placed = self._placed.get(_key(task)) if task.mm else None
        return None if placed is None else placed.pgd

    def forget_pgd(self, task: Task) -> None:
        """The page table root of ``task``'s process as placed is not the one it runs on."""
        key = _key(task)
        placed = self._placed.get(key)
        if placed is not None:
            self._placed[key] = dataclasses.replace(placed, pgd=None)

    async def _place(
        self,
        key: Key,
        vmas: tuple[Vma, ...],
        code: Reader,
        *,
        load: bool = True,
        pgd: int | None = None,
        partial: bool = False,
    ) -> AddressSpace:
        tables, seen = self.tables, code
        if pgd is not None and tables is not None:
            # What ``code`` does not show (an arm64 vCPU in kernel mode reads no user page:
            # PAN) is read through the process's own tables, walked by ``code`` too.
            code = _or_else(seen, lambda: tables.over(seen).reader(pgd))
        user = await user_modules(code, vmas, self.files, load=load, arch=self.arch)
        space = AddressSpace([*self.kernel.modules, *user]) if user else self.kernel
        waiting = any(vma.name and not self.files.read(vma.name) for vma in vmas)
        # A file's name that did not read leaves its code unnamed (``[anon]``): not trusted, the
        # next sample reads the mappings again (``confirm`` first, between samples).
        checked = self.clock() if _named(vmas) else -math.inf
        placed = Placed(space, checked, vmas, waiting, pgd=pgd, partial=partial)
        self._placed.put(key, placed)
        return space

    async def settle(self, read: Reader) -> bool:
        """Between samples, through ``read`` (kernel memory): read the files of one name a pause
        met, and place again each process that waited for files now read; False when there
        was nothing to do."""
        if not self.files.read_one():
            return False
        ready = [
            (key, placed)
            for key, placed in self._placed.items()
            if placed.waiting and all(not v.name or self.files.read(v.name) for v in placed.vmas)
        ]
        for key, placed in ready:
            if await self._place_again(read, key, placed) is None:
                del self._placed[key]  # the next sample places it
        return True

    def waiting(self, task: Task) -> bool:
        """Whether ``task``'s process's space was placed without files not read yet."""
        placed = self._placed.get(_key(task)) if task.mm else None
        return placed is not None and placed.waiting

    async def complete(self, read: Reader, task: Task) -> AddressSpace | None:
        """After cont, through ``read`` (kernel memory, while the guest runs): the space of
        ``task``'s process placed again with the files it waited for read now (None: not
        waiting, or its page tables unreadable; then the next sample places it)."""
        key = _key(task)
        placed = self._placed.get(key) if task.mm else None
        if placed is None or not placed.waiting:
            return None
        for vma in placed.vmas:
            if vma.name and not self.files.read(vma.name):
                self.files.candidates(vma.name)
        return await self._place_again(read, key, placed)

    async def _place_again(self, read: Reader, key: Key, placed: Placed) -> AddressSpace | None:
        """A process placed while its files were not read, placed again through its tables
        (in part still, when it was placed in part)."""
        return await self._place_through_tables(read, key, placed.vmas, partial=placed.partial)

    async def confirm(self, read: Reader) -> bool:
        """Every CONFIRM_EVERY seconds, through ``read`` (kernel memory, while the guest runs):
        the mappings of the process whose were read longest ago (of those sampled lately).
        Unchanged, they are trusted again, so no pause has to read them; changed, the next
        sample of it reads them (its code must be compared with the files under its own page
        tables; a space placed in part is placed whole here, through them). A process of many
        mappings is read a step a call (``VmaWalk``), one call after the other until done.
        False when nothing was read."""
        if self.vmas is None:
            return False
        if self._walk is None:
            key = self._due()
            if key is None:
                return False
            placed = self._placed[key]
            if not await self._many(read, key[0]):
                found = await read_exec_vmas(read, key[0], self.vmas, self.user_end)
                return await self._take_in(read, key, placed, tuple(found))
            self._walk = (key, placed, VmaWalk(key[0], self.vmas, self.user_end))
        key, placed, walk = self._walk
        if await walk.step(read):
            self._walk = None
            await self._take_in(read, key, placed, tuple(walk.found or ()))
        return True

    def _due(self) -> Key | None:
        """The process whose mappings ``confirm`` reads now: one placed in part, else the one
        read longest ago of those sampled lately; None: none, or not CONFIRM_EVERY yet."""
        now = self.clock()
        if now - self._confirmed < CONFIRM_EVERY:
            return None
        self._confirmed = now
        due = [
            (not placed.partial, placed.checked, key)
            for key, placed in self._placed.items()
            if placed.partial
            or (
                now - placed.checked >= RECHECK / 2
                and now - self._used.get(key, 0.0) <= 2 * RECHECK
            )
        ]
        return min(due)[2] if due else None

    async def _take_in(
        self, read: Reader, key: Key, placed: Placed, found: tuple[Vma, ...]
    ) -> bool:
        """Take in the mappings ``found`` of the process placed as ``placed``."""
        if self._placed.get(key) is not placed:
            return True  # read again meanwhile, or started over
        if found == placed.vmas:
            checked = self.clock() if _named(found) else -math.inf
            self._placed[key] = dataclasses.replace(placed, checked=checked, partial=False)
        elif not placed.partial or await self._place_through_tables(read, key, found) is None:
            del self._placed[key]
        return True


def _or_else(first: Reader, second: Callable[[], Reader]) -> Reader:
    """Reads through ``first``, those it could not read through ``second()`` (made then)."""

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        found = await first(ranges)
        missing = [i for i, data in enumerate(found) if data is None]
        if missing:
            again = await second()([ranges[i] for i in missing])
            for i, data in zip(missing, again, strict=True):
                found[i] = data
        return found

    return read


def _named(vmas: Sequence[Vma]) -> bool:
    """Whether each mapping of a file has the file's name (a read of it may fail)."""
    return all(v.name or not v.file for v in vmas)


def _holds(placed: Placed, pcs: Sequence[int]) -> bool:
    """Whether the mappings as placed answer for the user addresses ``pcs``."""
    find, lacking = placed.space.find, placed.lacking
    return all(pc >> 12 in lacking or find(pc) is not None for pc in pcs)


async def user_modules(
    read: Reader,
    vmas: Sequence[Vma],
    files: UserFiles,
    *,
    load: bool = True,
    arch: InstructionSet | None = None,
) -> list[Module]:
    """A Module per mapped file (an ELF from ``files`` at its load bias, when one matches the
    guest's bytes, walked in ``arch`` where it is the file's) and per anonymous executable
    mapping (frame pointers, named by mapping); ``load=False``: files not read yet are not read
    (those mappings are named alone)."""
    codes = await read([(v.start, _PROBE) for v in vmas])
    modules: list[Module] = []
    placed: set[str] = set()
    for vma, code in zip(vmas, codes, strict=True):
        offset = vma.pgoff * PAGE
        image = None if vma.name is None else files.match(vma.name, offset, code, load=load)
        if image is not None:
            if image.path not in placed:
                placed.add(image.path)
                bias = vma.start - offset - (image.load_range[0] - image.load_offset)
                modules.append(Module.from_image(image, kernel=False, bias=bias, arch=arch))
            continue
        name = f"[{vma.name or 'anon'}]"
        modules.append(Module(Mapping(name, vma.start, vma.end, False, file_offset=offset)))
    return _disjoint(modules)


def _disjoint(modules: list[Module]) -> list[Module]:
    """Modules by start, each cut short of the next (an ELF's range spans its data segments,
    which other mappings may follow closely)."""
    ordered = sorted(modules, key=lambda m: m.start)
    out = []
    for module, following in zip(ordered, [*ordered[1:], None][: len(ordered)], strict=True):
        if following is not None and module.end > following.start:
            mapping = dataclasses.replace(module.mapping, end=following.start)
            module = dataclasses.replace(module, mapping=mapping)
        out.append(module)
    return out
