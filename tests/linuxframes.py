"""A Linux guest's profile held against the guest's own word: kernel stacks whole, kernel frames
named as its /proc/kallsyms names them, and a process's user frames placed in the files its
/proc/PID/maps says are mapped there, named only by the symbols of those files.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from linuxvm import Mapping

from qmpprof.arch.base import InstructionSet
from qmpprof.linux.symbols import TEXT_TYPES, KernelSymbols
from qmpprof.model import Frame, StopReason
from qmpprof.profile import Profile

# The outermost frames a kernel stack may end with: entries from user space and interrupts,
# kernel threads' first frame, the idle tasks' start.
ENTRIES = ("entry_SYSCALL_64", "asm_", "ret_from_fork", "common_startup_64", "secondary_startup")


def whole_kernel_part(frames: tuple[Frame, ...] | list[Frame], stop: StopReason) -> bool:
    """The kernel frames of a kernel-mode stack are whole: every one named, and the walk went
    on into the user code beneath (a system call or an interrupt of user code) or ended at the
    outermost kernel frame (a kernel thread's or the idle loop's entry)."""
    kernel = [f for f in frames if f.kernel]
    if not kernel or any(f.symbol is None for f in kernel):
        return False
    if len(kernel) < len(frames):  # user frames follow: the entry was crossed
        return True
    outermost = kernel[-1].symbol or ""
    return stop is StopReason.END and outermost.startswith(ENTRIES)


class GuestNames:
    """The guest's text symbols: address -> every name a text symbol has there."""

    def __init__(self, symbols: KernelSymbols) -> None:
        names: dict[int, list[str]] = {}
        for addr, kind, name in zip(symbols.addrs, symbols.types, symbols.names, strict=True):
            if kind in TEXT_TYPES:
                names.setdefault(addr, []).append(name)
        self.addrs = sorted(names)
        self.names = [names[a] for a in self.addrs]

    def at(self, addr: int) -> list[str]:
        i = bisect.bisect_right(self.addrs, addr) - 1
        return self.names[i] if i >= 0 else []


def kernel_names(
    profile: Profile, table: GuestNames
) -> tuple[int, int, Counter[str], Counter[str]]:
    """(equal, total, wrong, names) over every kernel frame of every sample, weighted by count.
    A caller's return address may be the first byte of the next function (a call to a
    noreturn function ends its caller): the call is at pc - 1. A frame interrupted by an entry
    (pt_regs) has an exact pc, so either is the guest's name."""
    equal = total = 0
    wrong: Counter[str] = Counter()
    names: Counter[str] = Counter()
    for record, count in zip(profile.stacks, profile.counts, strict=True):
        for depth, fid in enumerate(record.frames):
            frame = profile.frames[fid]
            if not frame.kernel:
                continue
            want = table.at(frame.pc) if depth == 0 else table.at(frame.pc - 1)
            if depth and frame.symbol not in want:
                want = want + table.at(frame.pc)
            total += count
            names[frame.symbol or "?"] += count
            if frame.symbol in want:
                equal += count
            else:
                wrong[f"{frame.pc:#x}: qmpprof {frame.symbol} kallsyms {want}"] += count
    return equal, total, wrong, names


@dataclass(frozen=True, slots=True)
class DynamicSymbol:
    start: int  # link address
    end: int
    name: str


@dataclass(frozen=True, slots=True)
class SharedObject:
    """What a mapped file says of itself: its loadable segments and its .dynsym functions."""

    loads: tuple[tuple[int, int, int], ...]  # (file offset, size in file, link address)
    dynsym: tuple[DynamicSymbol, ...]
    has_symtab: bool

    def address_of(self, offset: int) -> int | None:
        """The link address of a file offset, through the PT_LOAD holding it."""
        for start, size, vaddr in self.loads:
            if start <= offset < start + size:
                return vaddr + offset - start
        return None

    def covering(self, addr: int) -> list[str]:
        """The .dynsym symbols whose [value, value + size) holds a link address."""
        return [s.name for s in self.dynsym if s.start <= addr < s.end]


@cache
def shared_object(path: Path) -> SharedObject:
    with path.open("rb") as f:
        elf = ELFFile(f)
        loads = tuple(
            (seg["p_offset"], seg["p_filesz"], seg["p_vaddr"])
            for seg in elf.iter_segments()
            if seg["p_type"] == "PT_LOAD"
        )
        table = elf.get_section_by_name(".dynsym")
        dynsym = tuple(
            DynamicSymbol(s["st_value"], s["st_value"] + s["st_size"], s.name)
            for s in (table.iter_symbols() if isinstance(table, SymbolTableSection) else ())
            if s["st_shndx"] != "SHN_UNDEF" and s["st_size"] and s.name
        )
        return SharedObject(loads, dynsym, elf.get_section_by_name(".symtab") is not None)


@dataclass
class UserFrames:
    """A process's user frames (weighted by samples) against its /proc/PID/maps."""

    total: int = 0
    placed: int = 0  # in the file mapped there (path and name), at its offset in that file
    named: int = 0  # with a symbol
    named_right: int = 0  # of them, by a .dynsym symbol of that file covering the address
    files: Counter[str] = field(default_factory=Counter)  # placed frames by file
    names: Counter[str] = field(default_factory=Counter)
    wrong: Counter[str] = field(default_factory=Counter)


def user_frames(profile: Profile, pid: int) -> Iterator[tuple[Frame, bool, int]]:
    """(frame, exact, count) for each user frame of the process's samples: ``exact`` for the
    interrupted pc (the stack's first user frame), the others are return addresses."""
    for record, count in zip(profile.stacks, profile.counts, strict=True):
        if record.process is None or record.process.pid != pid:
            continue
        frames = [profile.frames[fid] for fid in record.frames]
        users = [f for f in frames if not f.kernel]
        for depth, frame in enumerate(users):
            yield frame, depth == 0, count


def check_user_frames(
    profile: Profile, pid: int, maps: list[Mapping], rootfs: Path, taken_from: Path | None = None
) -> UserFrames:
    """Each user frame of process ``pid``: the maps line covering its address (a return
    address's call is at pc - 1) names the file the frame's Mapping must have (its path, and
    the file's name as its name) and the offset in it (pc - start + file_offset on both
    sides), and a frame's symbol must be a .dynsym symbol of
    that file whose [value, value + size) holds the address: never the nearest exported symbol
    below an internal function of a stripped file. ``taken_from``: the folder qmpprof took the
    files from when not ``rootfs`` (an initramfs it unpacked): the file there must hold the
    same bytes as ``rootfs``'s."""
    tally = UserFrames()
    same: dict[Path, bool] = {}
    for frame, exact, count in user_frames(profile, pid):
        tally.total += count
        lookup = frame.pc if exact else frame.pc - 1
        line = next((m for m in maps if m.start <= lookup < m.end), None)
        mapping = frame.module
        where = f"{frame.pc:#x} {frame.symbol} in {mapping.name if mapping else None}"
        if line is None or not line.path.startswith("/"):
            tally.wrong[f"{where}: maps has no file there ({line})"] += count
            continue
        file = (rootfs / line.path.lstrip("/")).resolve()
        taken = file if taken_from is None else (taken_from / line.path.lstrip("/")).resolve()
        offset = frame.pc - line.start + line.offset
        if mapping is None or mapping.path is None or Path(mapping.path).resolve() != taken:
            tally.wrong[f"{where}: maps says {line.path}"] += count
            continue
        if taken not in same:
            same[taken] = taken.read_bytes() == file.read_bytes()
        if not same[taken]:
            tally.wrong[f"{where}: {taken} is not {file}"] += count
            continue
        if mapping.name != file.name:
            tally.wrong[f"{where}: named {mapping.name}, the file is {file.name}"] += count
            continue
        if frame.pc - mapping.start + mapping.file_offset != offset:
            theirs = frame.pc - mapping.start + mapping.file_offset
            tally.wrong[f"{where}: offset {theirs:#x}, maps says {offset:#x}"] += count
            continue
        tally.placed += count
        tally.files[line.path] += count
        if frame.symbol is None:
            continue
        tally.named += count
        tally.names[f"{frame.symbol} ({Path(line.path).name})"] += count
        obj = shared_object(file)
        addr = obj.address_of(lookup - line.start + line.offset)
        covering = [] if addr is None else obj.covering(addr)
        if frame.symbol in covering:
            tally.named_right += count
        else:
            tally.wrong[f"{where}: .dynsym covering it: {covering or 'none'}"] += count
    return tally


@dataclass
class UserTally:
    """A program's user frames (xz's): in a file of the run's --user-dir (``rootfs``), at a
    return address a call precedes in that file's code (``arch.is_call_before``), named by a
    symbol of that file covering it."""

    arch: InstructionSet
    rootfs: Path
    total: int = 0
    placed: int = 0
    files: Counter[str] = field(default_factory=Counter)
    names: Counter[str] = field(default_factory=Counter)
    wrong: Counter[str] = field(default_factory=Counter)  # not placed
    misnamed: Counter[str] = field(default_factory=Counter)

    def __str__(self) -> str:
        return (
            f"xz's user frames placed {self.placed}/{self.total}, by file {dict(self.files)},"
            f" names {self.names.most_common(8)}, not placed {self.wrong.most_common(8)}"
        )

    def check(self, frame: Frame, *, exact: bool, count: int) -> None:
        """One user frame, ``count`` times; ``exact``: the interrupted pc (no call before it)."""
        self.total += count
        module = frame.module
        if module is None or module.path is None:
            self.wrong[f"{frame.pc:#x}: in no file"] += count
            return
        path = Path(module.path).resolve()
        if self.rootfs.resolve() not in path.parents:
            self.wrong[f"{frame.pc:#x}: {path} is not --user-dir's"] += count
            return
        self.files[module.name] += count
        link = frame.pc - module.bias
        elf = shared_object(path)
        word = code_word(path, elf.loads, link - 4)
        if not exact and (word is None or not self.arch.is_call_before(word, link)):
            self.wrong[f"{frame.pc:#x} in {module.name}: no call before it"] += count
            return
        self.placed += count
        if frame.symbol is not None:
            self.names[frame.symbol] += count
            at = link if exact else link - 1
            if frame.symbol not in elf.covering(at):
                self.misnamed[f"{frame.symbol} at {link:#x} in {module.name}"] += count


def code_word(path: Path, loads: Sequence[tuple[int, int, int]], vaddr: int) -> bytes | None:
    """The 4 bytes of the file at ``path`` at link address ``vaddr`` (``loads``: its PT_LOADs
    as (offset, size, start)); None outside them."""
    for offset, size, start in loads:
        if start <= vaddr < start + size:
            with path.open("rb") as f:
                f.seek(offset + vaddr - start)
                return f.read(4)
    return None


@dataclass
class ProcStackTally:
    """Off-CPU kernel stacks (``--one-shot --off-cpu`` JSON frames) against the guest's own
    /proc/PID/stack: each task's frames, those in a ``skipped`` range left out (what /proc
    leaves out of its listing), name for name."""

    skipped: Sequence[tuple[int | None, int | None]]
    equal: int = 0
    compared: int = 0
    unequal: list[tuple[int, str, list[str | None], list[str]]] = field(default_factory=list)

    @classmethod
    def of(cls, symbols: KernelSymbols) -> ProcStackTally:
        """Leaving out the scheduler's and the locks' text (``__sched_text_start``..,
        ``__lock_text_start``..), which /proc/PID/stack leaves out, as the kernel says."""
        return cls(
            [
                (
                    symbols.address_of(f"__{part}_text_start"),
                    symbols.address_of(f"__{part}_text_end"),
                )
                for part in ("sched", "lock")
            ]
        )

    def add(
        self, tid: int, program: str, frames: list[dict[str, Any]], expected: list[str]
    ) -> None:
        """One task's frames (kernel ones, leaf first) and /proc's names (empty: not read)."""
        ours = [
            f.get("symbol")
            for f in frames
            if not any(lo <= int(f["address"], 16) < hi for lo, hi in self.skipped if lo and hi)
        ]
        if not expected:
            return
        self.compared += 1
        self.equal += ours == expected
        if ours != expected:
            self.unequal.append((tid, program, ours, expected))
