"""Offline speed of the unwinder: unwind + symbolize samples per second, and ElfImage load time.

No guest needed: ``synthetic_stack`` lays out a stack that real CFI rows of a real ELF unwind
(one frame per chosen FDE, return addresses and saved registers where the rows say), so the
measurement runs the same code path as a live sample with warm caches. ``scripts/bench`` calls
``offline_rate`` and ``load_time``; they return numbers and never assert on them.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

from qmpprof.arch.x86 import X86_64
from qmpprof.arch.x86regs import x86_registers
from qmpprof.dwarf.cfi import Kind, Rule
from qmpprof.elf.image import ElfImage
from qmpprof.model import Registers
from qmpprof.pagecache import PAGE, PageCache, page_of
from qmpprof.unwind.chain import AddressSpace, Module, RawStack, Unwinder

STACK_TOP = 0x7FFF_0000_0000  # where the synthetic stack starts (grows up from here)


def running_code_path() -> Path:
    """The largest executable file mapped into this process (python or libpython)."""
    best: tuple[int, str] = (0, "")
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "x" in fields[1] and fields[5].startswith("/"):
            low, high = (int(v, 16) for v in fields[0].split("-"))
            best = max(best, (high - low, fields[5]))
    return Path(best[1])


def _usable(rule: Rule) -> bool:
    """Rows whose CFA is rsp-based and whose saved registers are plain stack slots."""
    ra = rule.reg(rule.ra)
    return (
        rule.cfa_expr is None
        and rule.cfa_reg == X86_64.sp
        and ra is not None
        and ra.kind is Kind.OFFSET
        and all(
            r.kind in (Kind.SAME, Kind.UNDEFINED)
            or (r.kind is Kind.OFFSET and -rule.cfa_offset <= r.value < 0)
            for _, r in rule.regs
        )
        and rule.start >= 0x1000
    )


def synthetic_stack(
    image: ElfImage, depth: int = 10
) -> tuple[Registers, PageCache, AddressSpace, int]:
    """Registers, stack pages and address space for a ``depth``-frame stack through ``image``'s
    CFI; also returns how many frames a correct unwind must find."""
    cfi = image.cfi
    if cfi is None:
        raise ValueError(f"{image.path} has no CFI")
    rules = []
    for fde in cfi.fdes():
        # The row with the deepest frame: the function body, where calls happen.
        usable = [r for r in cfi.rows(fde) if _usable(r)]
        if usable:
            rules.append(max(usable, key=lambda r: r.cfa_offset))
    if len(rules) < depth:
        raise ValueError(f"{image.path} has only {len(rules)} usable CFI rows")
    step = len(rules) // depth
    chosen = [rules[i * step] for i in range(depth)]
    words: dict[int, int] = {}
    sp = STACK_TOP
    for i, rule in enumerate(chosen):
        cfa = sp + rule.cfa_offset
        for reg, saved in rule.regs:
            if saved.kind is Kind.OFFSET and reg != rule.ra:
                words[cfa + saved.value] = 0x5000 + i
        # A caller's return address is one past its row start: lookups use address - 1.
        words[cfa - 8] = chosen[i + 1].start + 1 if i + 1 < depth else 0
        sp = cfa
    cache = PageCache()
    pages: dict[int, bytearray] = {}
    for addr, value in words.items():
        page = pages.setdefault(page_of(addr), bytearray(PAGE))
        struct.pack_into("<Q", page, addr - page_of(addr), value)
    cache.pages.update({base: bytes(page) for base, page in pages.items()})
    regs = x86_registers(0, {"rip": chosen[0].start, "rsp": STACK_TOP, "rbp": 0}, cpl=3, cr3=0)
    space = AddressSpace([Module.from_image(image, kernel=False)])
    return regs, cache, space, depth


def offline_rate(path: str | Path | None = None, *, depth: int = 10, samples: int = 20000) -> float:
    """Samples per second of Unwinder.unwind + symbolize on a ``depth``-frame stack (warm
    caches), best of five batches of ``samples / 5``."""
    image = ElfImage.load(path or running_code_path())
    regs, cache, space, expected = synthetic_stack(image, depth)
    unwinder = Unwinder(X86_64)
    raw: RawStack = unwinder.unwind(regs, cache, space)
    if len(raw.pcs) != expected:
        raise RuntimeError(f"synthetic stack unwound to {len(raw.pcs)} frames, not {expected}")
    unwinder.resolve(raw, space)
    # Best of several batches: the machine is shared, the fastest batch is the per-core rate.
    batch = max(1, samples // 5)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(batch):
            unwinder.resolve(unwinder.unwind(regs, cache, space), space)
        best = min(best, time.perf_counter() - start)
    return batch / best


def load_time(path: str | Path) -> dict[str, float]:
    """Seconds to load an ELF, build its symbol table, and index its CFI (first lookup)."""
    start = time.perf_counter()
    image = ElfImage.load(path)
    loaded = time.perf_counter()
    count = len(image.symbols)
    symbols = time.perf_counter()
    if image.cfi is not None:
        image.cfi.row_for(image.text_addr)
    cfi = time.perf_counter()
    return {
        "load_s": loaded - start,
        "symbols_s": symbols - loaded,
        "cfi_index_s": cfi - symbols,
        "symbols": float(count),
    }
