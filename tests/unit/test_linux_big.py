"""Big and absurd guests, with fake guest memory: a module of 30,000 symbols read in a few
reads, the ceilings on what a module claims (its name, symbols, text) and the line each cut
gives; a process of 65,530 mappings read in work that does not grow with the square of them, and
never walked whole inside a pause."""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import pytest
from fuzzing import GuestMemory, seed

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.x86 import X86_64
from qmpprof.guest.userfiles import UserFiles
from qmpprof.linux.running import modules as modules_module
from qmpprof.linux.running.modules import MAX_SYMBOLS, ModuleLayout, ModuleList
from qmpprof.linux.running.pagetables import PageTables
from qmpprof.linux.running.spaces import CONFIRM_EVERY, RECHECK, Spaces
from qmpprof.linux.running.tasks import Task
from qmpprof.linux.running.vma import (
    MAX_VMAS,
    STEP,
    VM_EXEC,
    VmaLayout,
    VmaWalk,
    find_exec_vmas,
    read_exec_vmas,
)
from qmpprof.memory import Reader
from qmpprof.pagecache import PAGE
from qmpprof.unwind.space import AddressSpace

HEAD = 0xFFFF_FFFF_82E0_0000  # the kernel's `modules` list head
MODULES = 0xFFFF_FFFF_C000_0000  # struct module, one every 0x1000 bytes
TEXTS = 0xFFFF_FFFF_C100_0000  # text, one module every 0x10_0000 bytes
KALLSYMS = 0xFFFF_FFFF_C800_0000
SYMTAB = 0xFFFF_FFFF_C900_0000
STRTAB = 0xFFFF_FFFF_CA00_0000
# struct module and mod_kallsyms as 6.12 lays them out, by hand (no BTF needed).
LAYOUT = ModuleLayout(
    list=8, name=24, name_size=56, text_base=0x100, text_size=0x108, kallsyms=0x110,
    symtab=0, num_symtab=8, strtab=16, orc=None,
)  # fmt: skip


class Memory:
    """Sparse guest memory by page; reads of an unwritten page fail, as an unmapped one does."""

    def __init__(self) -> None:
        self.pages: dict[int, bytearray] = {}
        self.reads: list[tuple[int, int]] = []
        self.requests: list[int] = []  # ranges of each request

    def put(self, addr: int, data: bytes) -> None:
        at = 0
        while at < len(data):
            page, offset = divmod(addr + at, PAGE)
            chunk = data[at : at + PAGE - offset]
            self.pages.setdefault(page, bytearray(PAGE))[offset : offset + len(chunk)] = chunk
            at += len(chunk)

    def get(self, addr: int, size: int) -> bytes | None:
        out = bytearray()
        for page in range(addr // PAGE, (addr + size - 1) // PAGE + 1):
            if page not in self.pages:
                return None
            out += self.pages[page]
        return bytes(out[addr % PAGE : addr % PAGE + size])

    def reader(self) -> Reader:
        async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
            self.reads += ranges
            self.requests.append(len(ranges))
            return [self.get(addr, size) for addr, size in ranges]

        return read


def module(memory: Memory, index: int, name: bytes, text_size: int, symbols: int = 0) -> int:
    """Module ``index``: its struct, text of ``text_size`` bytes, ``symbols`` function symbols
    named f0, f1, ... 16 bytes apart; its address."""
    at, text = MODULES + index * 0x1000, TEXTS + index * 0x10_0000
    memory.put(at + LAYOUT.name, name.ljust(LAYOUT.name_size, b"\0")[: LAYOUT.name_size])
    memory.put(at + LAYOUT.text_base, struct.pack("<Q", text))
    memory.put(at + LAYOUT.text_size, struct.pack("<I", text_size))
    memory.put(text, bytes(min(text_size, 0x10_0000)))
    memory.put(at + LAYOUT.kallsyms, struct.pack("<Q", KALLSYMS if symbols else 0))
    if symbols:
        words = [b"f%d\0" % i for i in range(symbols)]
        offsets, at_name = [], 0
        for word in words:
            offsets.append(at_name)
            at_name += len(word)
        names = b"".join(words)
        table = b"".join(
            struct.pack("<IBBHQQ", name, 2, 0, 1, text + 16 * i, 16)  # STT_FUNC
            for i, name in enumerate(offsets)
        )
        memory.put(KALLSYMS, struct.pack("<QIxxxxQ", SYMTAB, symbols, STRTAB))
        memory.put(SYMTAB, table)
        memory.put(STRTAB, names + bytes(PAGE))
    return at


def link(memory: Memory, chain: Sequence[int]) -> None:
    """The circular list from HEAD through each struct module's ``list`` member."""
    nodes = [HEAD, *(at + LAYOUT.list for at in chain)]
    for node, following in zip(nodes, [*nodes[1:], HEAD], strict=True):
        memory.put(node, struct.pack("<Q", following))


async def test_a_module_of_30000_symbols_is_named_whole_in_a_few_reads() -> None:
    memory = Memory()
    link(memory, [module(memory, 0, b"big", 0x8_0000, symbols=30_000)])
    modules = ModuleList(memory.reader(), HEAD, LAYOUT, None, X86_64)
    (found,) = await modules.refresh() or []
    assert found.symbols is not None and len(found.symbols) == 30_000
    assert found.symbols.lookup(TEXTS + 16 * 29_999 + 4) == ("f29999", 4)
    assert found.symbols.lookup(TEXTS + 16 * 12_345) == ("f12345", 0)
    # The list's links, the struct's fields, the symbol and string tables each read whole:
    # the count of reads does not grow with the symbols'.
    assert len(memory.reads) <= 12 and not modules.notes


async def test_a_module_claiming_too_many_symbols_keeps_the_first_and_says_so() -> None:
    memory = Memory()
    link(memory, [module(memory, 0, b"big", 0x8_0000, symbols=1000)])
    memory.put(KALLSYMS + LAYOUT.num_symtab, struct.pack("<I", 0xFFFF_FFFF))
    memory.put(SYMTAB + 1000 * 24, bytes((MAX_SYMBOLS - 1000) * 24))  # readable, no functions
    modules = ModuleList(memory.reader(), HEAD, LAYOUT, None, X86_64)
    (found,) = await modules.refresh() or []
    assert found.symbols is not None and len(found.symbols) == 1000
    assert max(size for addr, size in memory.reads if addr == SYMTAB) == MAX_SYMBOLS * 24
    assert modules.notes == [f"module big: 4294967295 symbols, the first {MAX_SYMBOLS:,} kept"]


async def test_a_module_name_claimed_4_gib_long_is_read_as_a_name_is() -> None:
    memory = Memory()
    layout = replace(LAYOUT, name_size=1 << 32)
    link(memory, [module(memory, 0, b"huge", 0x1000)])
    (found,) = await ModuleList(memory.reader(), HEAD, layout, None, X86_64).refresh() or []
    assert found.name == "[huge]"
    assert [size for addr, size in memory.reads if addr == MODULES + LAYOUT.name] == [256]


async def test_module_text_is_read_up_to_its_ceilings_and_a_cut_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # arm64 modules (no ORC tables): their text read for prologue analysis, each up to
    # MAX_TEXT, all together up to TEXT_BUDGET (scaled down here: the same code).
    monkeypatch.setattr(modules_module, "MAX_TEXT", 0x3000)
    monkeypatch.setattr(modules_module, "TEXT_BUDGET", 0x5000)
    memory = Memory()
    sizes = [0x2000, 0x4000, 0x2000, 0x2000]  # the second over MAX_TEXT, the fourth the budget
    chain = [module(memory, i, b"m%d" % i, size) for i, size in enumerate(sizes)]
    link(memory, chain)
    modules = ModuleList(memory.reader(), HEAD, LAYOUT, None, AARCH64)
    found = await modules.refresh() or []
    assert [m.name for m in found] == ["[m0]", "[m1]", "[m2]", "[m3]"]
    text_reads = {addr for addr, size in memory.reads if size >= 0x2000}
    assert text_reads == {TEXTS, TEXTS + 2 * 0x10_0000}
    assert [note.split(":")[0] for note in modules.notes] == ["module m1", "module m3"]
    assert all("bytes of text not read" in note for note in modules.notes)
    # m0 unloaded: its text no longer counts, the next module read in full fits.
    link(memory, [*chain[1:], module(memory, 4, b"m4", 0x2000)])
    await modules.refresh()
    assert TEXTS + 4 * 0x10_0000 in {addr for addr, _ in memory.reads}
    assert len(modules.notes) == 2


# A process's mappings: mm_struct, vm_area_struct and maple nodes laid out by hand (offsets as
# BTF would give them; the maple ones are 6.12's: pivots after the parent, 15 of a range node's
# and 9 of an allocation range's, then the slots).
VMAS = VmaLayout(
    maple=True, vmas=0x40, vm_next=0x50, leaf_slots=(0x80, 16), arange_slots=(0x50, 10),
    node_size=256, types=(1, 2, 3), vm_start=0, vm_end=8, vm_mm=0x10, vm_flags=0x20,
    vm_pgoff=0x28, vm_file=0x30, dentry=0x18, name=0x28, pgd=0x48, map_count=0x50,
    pivots=(8, 8), rb_root=0x58, vm_rb=0x38,
)  # fmt: skip
MM = 0xFFFF_8880_0100_0000
VMA_AT = 0xFFFF_8880_1000_0000  # vm_area_struct i at VMA_AT + 0x80 * i
NODES = 0xFFFF_8880_2000_0000  # maple nodes, 256 bytes each
USER = 0x5555_0000_0000  # mapping i at USER + 2 pages * i, a page long
BIG = 65_530  # vm.max_map_count's default
EXEC = frozenset({7, 40_000, BIG - 1})  # the executable ones (anonymous: no file)
LEAF, RANGE, ARANGE = 1, 2, 3


def vmas(memory: Memory, count: int) -> list[int]:
    """``count`` mappings of MM, each a page with a page's gap after it; their addresses."""
    out = []
    for i in range(count):
        at, start = VMA_AT + 0x80 * i, USER + 2 * PAGE * i
        flags = VM_EXEC if i in EXEC else 0
        memory.put(at, struct.pack("<QQQQQQQ", start, start + PAGE, MM, 0, flags, 0, 0))
        out.append(at)
    memory.put(MM + VMAS.map_count, struct.pack("<I", count))
    return out


def maple(memory: Memory, entries: list[tuple[int, int]]) -> None:
    """A maple tree of ``entries`` (last index, VMA; a page's gap after each, a NULL slot),
    built bottom up: leaves of up to 8 ranges (a VMA and its gap), then range nodes of up to
    16 children, the root an allocation range."""
    slots: list[tuple[int, int]] = []  # (entry, last index)
    for last, vma in entries:
        slots += [(vma, last), (0, last + PAGE)]
    level, kind = slots, LEAF
    node = NODES
    while True:
        width = 16
        if len(level) <= 10 and kind != LEAF:
            kind, width = ARANGE, 10
        parents = []
        for group in range(0, len(level), width):
            chunk = level[group : group + width]
            slot_at = 0x50 if kind == ARANGE else 0x80  # after 9 pivots, or 15
            pivots = [last for _, last in chunk[:-1]]
            memory.put(node + 8, struct.pack(f"<{len(pivots)}Q", *pivots))
            memory.put(node + slot_at, struct.pack(f"<{len(chunk)}Q", *(e for e, _ in chunk)))
            parents.append((node | kind << 3 | 2, chunk[-1][1]))
            node += 256
        if kind == ARANGE:
            memory.put(MM + VMAS.vmas, struct.pack("<Q", parents[0][0]))
            return
        level, kind = parents, RANGE


def rbtree(memory: Memory, pointers: list[int]) -> None:
    """``mm_rb``: a balanced tree of the VMAs by address (colours left out: never read)."""

    def build(low: int, high: int) -> int:
        if low >= high:
            return 0
        middle = (low + high) // 2
        node = pointers[middle] + VMAS.vm_rb
        left, right = build(low, middle), build(middle + 1, high)
        memory.put(node + 8, struct.pack("<QQ", right, left))
        return node

    memory.put(MM + VMAS.rb_root, struct.pack("<Q", build(0, len(pointers))))


def big_process(*, is_maple: bool) -> tuple[Memory, VmaLayout]:
    memory = Memory()
    pointers = vmas(memory, BIG)
    if is_maple:
        maple(memory, [(USER + 2 * PAGE * i + PAGE - 1, p) for i, p in enumerate(pointers)])
        return memory, VMAS
    rbtree(memory, pointers)
    return memory, replace(VMAS, maple=False)


@pytest.mark.parametrize("is_maple", [True, False], ids=["maple", "rbtree"])
async def test_the_mappings_holding_addresses_are_found_down_the_tree(is_maple: bool) -> None:
    memory, layout = big_process(is_maple=is_maple)
    wanted = [USER + 2 * PAGE * i + 0x123 for i in (7, 40_000, BIG - 1, 8)]  # 8: not code
    wanted.append(USER + 2 * PAGE * 9 + PAGE)  # in a gap
    found = await find_exec_vmas(memory.reader(), MM, layout, 1 << 47, wanted)
    assert [v.start for v in found] == [USER + 2 * PAGE * i for i in sorted(EXEC)]
    # The root, a node a level for each address (this maple tree is 5 deep, this red-black
    # one 16), the mapping found: of 65,530, never more than that.
    height = 5 if is_maple else 16
    assert len(memory.reads) <= 1 + len(wanted) * (height + 1)


async def test_a_maple_tree_of_65530_mappings_is_read_whole_between_samples() -> None:
    memory, layout = big_process(is_maple=True)
    found = await read_exec_vmas(memory.reader(), MM, layout, 1 << 47)
    assert [v.start for v in found] == [USER + 2 * PAGE * i for i in sorted(EXEC)]
    assert max(memory.requests) <= STEP  # a transport is never asked for 65,530 at once


class Tables:
    """PageTables as a process's own reader of its user memory: its code, zeros."""

    user_end = 1 << 47

    def reader(self, pgd: int) -> Reader:
        async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
            return [bytes(n) for _, n in ranges]

        return read

    def over(self, read: Reader) -> Tables:
        return self


async def test_a_pause_looks_up_a_big_process_s_mappings_and_the_walk_is_done_between_samples() -> (
    None
):
    memory, layout = big_process(is_maple=True)
    memory.put(MM + layout.pgd, struct.pack("<Q", 0xFFFF_8880_0700_0000))
    now = [0.0]
    spaces = Spaces(AddressSpace(()), layout, UserFiles(None), cast(PageTables, Tables()),
                    lambda: now[0])  # fmt: skip
    task = Task(4242, 4242, "many", False, "many", MM, 0)
    # Before the first stop: not walked (only its count of mappings read), not placed.
    assert await spaces.preload(memory.reader(), task) is None
    assert memory.reads == [(MM + layout.map_count, 4)]
    memory.reads.clear()
    pc = USER + 2 * PAGE * 40_000 + 0x10
    space = await spaces.space_of(memory.reader(), task, [pc])
    # In the pause: its count of mappings, a descent of the tree, the mapping, its tables.
    found = space.find(pc)
    assert found is not None and found.start == USER + 2 * PAGE * 40_000
    assert space.find(USER + 2 * PAGE * 7) is None
    assert len(memory.reads) <= 12
    memory.reads.clear()
    # Between samples, a call after the other: the whole tree, STEP ranges a call at most.
    now[0] = CONFIRM_EVERY
    steps = []
    while await spaces.confirm(memory.reader()):
        steps.append(len(memory.reads))
        memory.reads.clear()
    # The nodes (8,739), then the VMAs by the page (2,048), each read once.
    assert max(steps) <= STEP + 1 and sum(steps) < 8_739 + 2_048 + 10

    now[0] = 2 * RECHECK  # past RECHECK: a pause reads its count of mappings, no more
    space = await spaces.space_of(memory.reader(), task, [USER + 2 * PAGE * 7])
    assert [m.start for m in space.modules] == [USER + 2 * PAGE * i for i in sorted(EXEC)]
    assert memory.reads == [(MM + layout.map_count, 4)]


async def test_a_list_of_65530_mappings_is_read_whole_each_link_once() -> None:
    # 5.10's mm->mmap list; its last link back to its first (a pointer read mid-change): the
    # walk ends all the same.
    memory, layout = Memory(), replace(VMAS, maple=False)
    pointers = vmas(memory, BIG)
    for vma, following in zip(pointers, [*pointers[1:], pointers[0]], strict=True):
        memory.put(vma + layout.vm_next, struct.pack("<Q", following))
    memory.put(MM + layout.vmas, struct.pack("<Q", pointers[0]))
    found = await read_exec_vmas(memory.reader(), MM, layout, 1 << 47)
    assert [v.start for v in found] == [USER + 2 * PAGE * i for i in sorted(EXEC)]
    pages = {vma // PAGE for vma in pointers}  # 32 VMAs a page here
    assert len(memory.reads) == 1 + BIG + len(pages)  # the root, each link, each page once


async def test_lookups_and_steps_over_random_guest_memory_end() -> None:
    """Trees whose pointers loop or hold themselves (tests/fuzzing.py's guest memory): every
    lookup and every walk in steps ends, nothing escapes."""
    rng = random.Random(seed())
    bound = 2 * MAX_VMAS // STEP + 4  # the nodes', then the VMAs' steps; root and names
    for _ in range(100):
        memory = GuestMemory(rng, (MM, VMA_AT, NODES))
        for layout in (VMAS, replace(VMAS, maple=False)):
            mm = memory.pointer()
            addrs = [rng.getrandbits(47) for _ in range(3)] + [memory.pointer() % (1 << 47)]
            for vma in await find_exec_vmas(memory.read, mm, layout, 1 << 47, addrs):
                assert any(vma.start <= a < vma.end for a in addrs) and vma.exec
            walk, steps = VmaWalk(mm, layout, 1 << 47), 0
            while not await walk.step(memory.read) and steps < bound:
                steps += 1
            assert walk.found is not None and len(walk.found) <= MAX_VMAS
