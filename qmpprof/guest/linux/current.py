"""Which task a Linux vCPU runs: the per-CPU current-task pointer, and the stacks it owns.

The pointer is a per-CPU variable (``current_task``, or a field of ``pcpu_hot`` on the kernels
that have it; ``CurrentTask.locate`` finds it from BTF or kallsyms). A vCPU's per-CPU base is
``__per_cpu_offset[cpu]``, read once (before the first stop, by ``preload``); without that
symbol, the base the CPU holds in kernel mode. The pointer is read with the stack window
(``reads_for``). A stack belongs to one task (a kernel stack; a user stack page in one address
space to one thread): once the pointer said whose stack the stack pointer is on, samples on
that stack page skip the pointer for ``recheck`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qmpprof.arch.base import InstructionSet
from qmpprof.linux.btf import Btf
from qmpprof.memo import Memo
from qmpprof.memory import Reader, fetch_piece, read_ints
from qmpprof.model import Registers
from qmpprof.pagecache import PageCache
from qmpprof.transport.base import GuestTransport

_OWNERS_LIMIT = 4096
PER_CPU_AREA = 1 << 24  # a per-CPU variable's offset is below this (kallsyms' per-CPU addresses)


def current_offset(btf: Btf, per_cpu_symbol: Callable[[str], int | None]) -> int:
    """The current task pointer's offset in the per-CPU area: from BTF's per-CPU variables,
    else from ``per_cpu_symbol`` (kallsyms: a per-CPU variable's address there is its offset
    in the per-CPU area), for kernels whose BTF has no variables (Debian's 5.10, built with an
    older pahole). Raises KeyError when neither has it."""
    for name in ("pcpu_hot", "current_task"):
        try:
            base, _ = btf.percpu(name)
        except KeyError:
            found = per_cpu_symbol(name)
            if found is None or found >= PER_CPU_AREA:
                continue
            base = found
        return base + btf.offset_of("pcpu_hot.current_task") if name == "pcpu_hot" else base
    raise KeyError("the per-CPU variable current_task (in BTF or kallsyms)")


class CurrentTask:
    """Reads each vCPU's current task pointer at ``base + offset`` (``offset``: the pointer's
    place in the per-CPU area); ``per_cpu_offset``: the runtime address of the
    ``__per_cpu_offset`` array (None: unknown)."""

    def __init__(
        self,
        offset: int,
        per_cpu_offset: int | None,
        arch: InstructionSet,
        clock: Callable[[], float],
        recheck: float,
    ) -> None:
        self.offset = offset
        self.per_cpu_offset = per_cpu_offset
        self.arch = arch
        self.clock = clock
        self.recheck = recheck
        self.bases: dict[int, int] = {}  # vCPU -> its per-CPU base
        # (0 or the address space, stack page) -> the task whose stack it is, when the pointer
        # said so
        self._owners: Memo[tuple[int, int], tuple[int, float]] = Memo(_OWNERS_LIMIT)

    async def preload(self, read: Reader, cpus: Sequence[int]) -> None:
        """Every vCPU's per-CPU base, read while the guest runs (before the first stop)."""
        if self.per_cpu_offset is None:
            return
        found = await read_ints(read, [(self.per_cpu_offset + 8 * cpu, 8) for cpu in cpus])
        self.bases.update({cpu: base for cpu, base in zip(cpus, found, strict=True) if base})

    def reads_for(self, regs: Registers) -> Sequence[tuple[int, int]]:
        base = self.bases.get(regs.cpu)
        if base is None or self.owner(regs) is not None:
            return ()
        return ((base + self.offset, 8),)

    def owner(self, regs: Registers) -> int | None:
        """The task whose stack the stack pointer is on, when the current task's pointer said
        so within ``recheck`` seconds: then the pointer need not be read."""
        owned = self._owners.get(_stack_page(regs))
        if owned is None or self.clock() - owned[1] > self.recheck:
            return None
        return owned[0]

    def own(self, regs: Registers, task: int) -> None:
        """The stack ``regs`` stand on is ``task``'s."""
        self._owners.put(_stack_page(regs), (task, self.clock()))

    async def pointer(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> int | None:
        """The current task pointer of ``regs.cpu`` (None: unknown), read through the sample's
        ``cache`` (which holds it when ``reads_for`` asked for it)."""
        base = await self._base(transport, regs, cache)
        if base is None:
            return None
        addr = base + self.offset
        await fetch_piece(transport, cache, regs.cpu, addr, 8)
        task = cache.read_u64(addr)
        return task if task and task >= self.arch.shared_from else None

    async def _base(
        self, transport: GuestTransport, regs: Registers, cache: PageCache
    ) -> int | None:
        base = self.bases.get(regs.cpu)
        if base is not None:
            return base
        if self.per_cpu_offset is not None:
            addr = self.per_cpu_offset + 8 * regs.cpu
            await fetch_piece(transport, cache, regs.cpu, addr, 8)
            base = cache.read_u64(addr)
        else:
            base = self.arch.per_cpu_base(regs)
        if base:
            self.bases[regs.cpu] = base
        return base or None


def _stack_page(regs: Registers) -> tuple[int, int]:
    # Kernel stacks look the same in every address space; a user stack page belongs to its own.
    return (regs.space if regs.user else 0, regs.sp >> 12)
