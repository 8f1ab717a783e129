"""Which task a Linux vCPU runs: the per-CPU current-task pointer, and the stacks it owns.

The pointer is a per-CPU variable (``current_task``, or a field of ``pcpu_hot`` on the kernels
that have it, 6.2 to 6.14; ``locate_current`` finds it in BTF, else kallsyms or, arm64's
``__entry_task``, the kernel's code: ``LinuxKernel.data_symbol``). Where it is for a vCPU:
``__per_cpu_offset[cpu]`` plus the variable's address. What that address is the image
says (``LinuxKernel.per_cpu_start``): an offset into a zero-based per-CPU area (x86_64 up to
6.x; KASLR leaves it alone), or an ordinary address of the image (7.x), which moves with the
slide. ``__per_cpu_offset[cpu]`` is read once (before the first stop, by ``preload``); without
that symbol, the base the CPU holds in kernel mode serves. The pointer is read with the stack
window (``reads_for``), every sample: 8 bytes in the same request. A stack belongs to one task
(a kernel stack; a user stack page in one address space to one thread): once the pointer said
whose stack the stack pointer is on, that task is the one expected on that stack page for
``recheck`` seconds (``owner``), so that its stamp is read with the window too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qmpprof.arch.base import InstructionSet
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.memo import Memo
from qmpprof.memory import Reader, fetch_piece, read_ints
from qmpprof.model import Registers
from qmpprof.pagecache import PageCache

_OWNERS_LIMIT = 4096
PRELOAD_TRIES = 10  # passes over the per-CPU bases while none reads (0.2 s at most)
PRELOAD_PAUSE = 0.02  # seconds between two
# The per-CPU variables that hold the current task, by the kernels' names: on x86_64 pcpu_hot
# (its field current_task) from 6.2 to 6.14, current_task before and after; on arm64
# __entry_task (the kernel's SP_EL0 holds it too; this one is there in user mode as well).
_HOLDERS = ("pcpu_hot", "current_task", "__entry_task")


@dataclass(frozen=True, slots=True)
class PerCpuVariable:
    """A per-CPU variable's link address (an offset where the per-CPU area is zero-based) and
    whether KASLR moves it (the area is ordinary data of the image)."""

    link: int
    moves: bool

    def at(self, slide: int) -> int:
        """What to add to a vCPU's ``__per_cpu_offset`` to reach it in the running kernel."""
        return self.link + slide if self.moves else self.link


def locate_current(kernel: LinuxKernel) -> tuple[PerCpuVariable, str | None]:
    """The current task pointer, and a line when BTF and kallsyms disagree on where it is.
    BTF's per-CPU variables go first (their offsets into the per-CPU section), kallsyms next
    (for kernels whose BTF has no variables: Debian's 5.10, built with an older pahole; on
    arm64 the kernel's code where kallsyms name no data). Raises KeyError naming what is
    missing."""
    area = kernel.per_cpu_start
    btf = kernel.btf
    if area is None or btf is None:
        raise KeyError("a per-CPU area (.data..percpu) and BTF")
    for name in _HOLDERS:
        from_symbols = kernel.data_symbol(name)
        try:
            link: int | None = area + btf.percpu(name)[0]
        except KeyError:
            link = None
        found = link if link is not None else from_symbols
        if found is None:
            continue
        note = None
        if link is not None and from_symbols is not None and from_symbols != link:
            note = f"BTF puts {name} at {link:#x}, kallsyms at {from_symbols:#x}: BTF taken"
        field = btf.offset_of("pcpu_hot.current_task") if name == "pcpu_hot" else 0
        return PerCpuVariable(found + field, area != 0), note
    raise KeyError("the per-CPU variable current_task (in BTF or kallsyms)")


class CurrentTask:
    """Reads each vCPU's current task pointer at ``base + offset`` (``offset``: the pointer's
    place in the per-CPU area); ``per_cpu_offset``: the runtime address of the
    ``__per_cpu_offset`` array (None: unknown); ``base_of``: the per-CPU base as a vCPU's
    registers hold it, where they do (the platform's ``per_cpu_base``)."""

    def __init__(
        self,
        offset: int,
        per_cpu_offset: int | None,
        arch: InstructionSet,
        clock: Callable[[], float],
        recheck: float,
        base_of: Callable[[Registers], int | None] | None = None,
    ) -> None:
        self.offset = offset
        self.per_cpu_offset = per_cpu_offset
        self.base_of = base_of
        self.arch = arch
        self.clock = clock
        self.recheck = recheck
        self.bases: dict[int, int] = {}  # vCPU -> its per-CPU base
        self.per_cpu = True  # the pointer is in a per-CPU slot (not in a register)
        # (0 or the address space, stack page) -> the task whose stack it is, when the pointer
        # said so
        self._owners: Memo[tuple[int, int], tuple[int, float]] = Memo(_OWNERS_LIMIT)

    async def preload(self, read: Reader, cpus: Sequence[int], tries: int = PRELOAD_TRIES) -> None:
        """Every vCPU's per-CPU base, read while the guest runs (before the first stop), in up
        to ``tries`` passes PRELOAD_PAUSE apart while none reads: a kernel that unmaps itself
        in user mode (KPTI) reads through a vCPU only while one runs the kernel, and a guest
        whose vCPUs spin in user code may have none there at one instant (arm64 7.x over QMP:
        then no user-mode sample named its process until a kernel-mode one had read a base)."""
        if self.per_cpu_offset is None:
            return
        for attempt in range(tries):
            found = await read_ints(read, [(self.per_cpu_offset + 8 * cpu, 8) for cpu in cpus])
            self.bases.update({cpu: base for cpu, base in zip(cpus, found, strict=True) if base})
            if self.bases or attempt + 1 == tries:
                return
            await asyncio.sleep(PRELOAD_PAUSE)

    async def running(self, read: Reader) -> dict[int, int]:
        """Each vCPU's current task (of the vCPUs whose per-CPU base is known): task -> vCPU."""
        cpus = sorted(self.bases)
        found = await read_ints(
            read, [((self.bases[cpu] + self.offset) & self.arch.mask, 8) for cpu in cpus]
        )
        return {task: cpu for cpu, task in zip(cpus, found, strict=True) if task}

    def wants(self, regs: Registers) -> tuple[str, ...]:
        """The system registers ``pointer`` needs beyond ``regs`` (none: the pointer is in
        memory)."""
        return ()

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        base = self.bases.get(regs.cpu)
        if base is None:
            return ()
        return (((base + self.offset) & self.arch.mask, 8),)

    def held(self, regs: Registers) -> int | None:
        """The current task where the sampled registers hold it (None: in memory, read by
        ``pointer``)."""
        return None

    def owner(self, regs: Registers) -> int | None:
        """The task whose stack the stack pointer is on, when the current task's pointer said
        so within ``recheck`` seconds: the task a sample there expects."""
        owned = self._owners.get(_stack_page(regs))
        if owned is None or self.clock() - owned[1] > self.recheck:
            return None
        return owned[0]

    def own(self, regs: Registers, task: int) -> None:
        """The stack ``regs`` stand on is ``task``'s."""
        self._owners.put(_stack_page(regs), (task, self.clock()))

    async def pointer(self, read: Reader, regs: Registers, cache: PageCache) -> int | None:
        """The current task pointer of ``regs.cpu`` (None: unknown), read through the sample's
        ``cache`` (which holds it when ``reads_for`` asked for it), else by ``read``."""
        base = await self._base(read, regs, cache)
        if base is None:
            return None
        addr = (base + self.offset) & self.arch.mask  # a 7.x variable's address wraps
        await fetch_piece(read, cache, addr, 8)
        task = cache.read_u64(addr)
        return task if task and task >= self.arch.shared_from else None

    async def _base(self, read: Reader, regs: Registers, cache: PageCache) -> int | None:
        base = self.bases.get(regs.cpu)
        if base is not None:
            return base
        if self.per_cpu_offset is not None:
            addr = self.per_cpu_offset + 8 * regs.cpu
            await fetch_piece(read, cache, addr, 8)
            base = cache.read_u64(addr)
        elif self.base_of is not None:
            base = self.base_of(regs)
        if base:
            self.bases[regs.cpu] = base
        return base or None


def _stack_page(regs: Registers) -> tuple[int, int]:
    # Kernel stacks look the same in every address space; a user stack page belongs to its own.
    return (regs.space if regs.user else 0, regs.sp >> 12)
