"""Counted stacks: what a run collected, turned into named frames root first, plus run facts.

A Profile keeps every sample in time order (speedscope's time view needs them) and the counts of
unique stacks (folded output and flame graphs need those). Pure data and pure transforms only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from qmpprof.model import Frame, Sample

KERNEL_ROOT = "kernel"
KERNEL_SUFFIX = "_[k]"
INLINED_SUFFIX = "_[i]"
TRUNCATED = "[truncated]"
UNKNOWN = "[unknown]"


@dataclass(frozen=True, slots=True)
class Naming:
    """How frames are turned into names."""

    show_addresses: bool = False  # append @0x... to every frame
    offsets: bool = False  # function+0x1f
    lines: bool = False  # function (file:line)
    mark_kernel: bool = True  # _[k] on kernel frames when the sample belongs to a process


def frame_name(frame: Frame, naming: Naming, mark_kernel: bool) -> str:
    if frame.symbol is None:
        # A program without symbols is still told apart by address; elsewhere an address that
        # no symbol covers is one [unknown] bucket unless addresses are asked for.
        by_address = naming.show_addresses or frame.module == UNKNOWN
        name = f"{frame.pc:#x}" if by_address else UNKNOWN
    else:
        name = frame.symbol
        if naming.offsets:
            name = f"{name}+{frame.offset:#x}"
        if naming.lines and frame.file is not None:
            name = f"{name} ({frame.file}:{frame.line})"
        if naming.show_addresses:
            name = f"{name} @{frame.pc:#x}"
    if frame.inlined:
        name += INLINED_SUFFIX
    if mark_kernel and frame.kernel:
        name += KERNEL_SUFFIX
    return name.replace(";", ":").replace("\n", " ")


def stack_names(sample: Sample, naming: Naming) -> tuple[str, ...]:
    """Names of a sample's frames root first: the context (process or ``kernel``) is the root."""
    root = sample.process.label if sample.process is not None else KERNEL_ROOT
    mark = naming.mark_kernel and sample.process is not None
    names = [frame_name(f, naming, mark) for f in reversed(sample.stack.frames)]
    if sample.stack.truncated:
        names.insert(0, TRUNCATED)
    return (root.replace(";", ":"), *names)


@dataclass(frozen=True, slots=True)
class TimedStack:
    time: float
    cpu: int
    names: tuple[str, ...]
    kernel: tuple[bool, ...]  # per name: is it a kernel frame (for colouring)


@dataclass(slots=True)
class Profile:
    """Everything a run collected. ``facts`` are shown in titles and summaries (ordered)."""

    samples: list[TimedStack] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)
    interval_ms: float = 10.0

    def add(self, sample: Sample, naming: Naming) -> None:
        names = stack_names(sample, naming)
        pad = len(names) - len(sample.stack.frames)
        kernel = (False,) * pad + tuple(f.kernel for f in reversed(sample.stack.frames))
        self.samples.append(TimedStack(sample.time, sample.cpu, names, kernel))

    def counts(self) -> Counter[tuple[str, ...]]:
        return Counter(s.names for s in self.samples)

    @property
    def cpus(self) -> list[int]:
        return sorted({s.cpu for s in self.samples})

    def top_functions(self, n: int = 10) -> list[tuple[str, int]]:
        """Self samples per leaf frame name, most first."""
        leaves = Counter(s.names[-1] for s in self.samples)
        return sorted(leaves.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

    @classmethod
    def from_stacks(cls, stacks: Iterable[tuple[str, ...]], interval_ms: float = 10.0) -> Profile:
        """A profile from plain name tuples (for tests and for re-reading folded files)."""
        profile = cls(interval_ms=interval_ms)
        for i, names in enumerate(stacks):
            kernel = tuple(n.endswith(KERNEL_SUFFIX) for n in names)
            profile.samples.append(TimedStack(i * interval_ms / 1000, 0, names, kernel))
        return profile
