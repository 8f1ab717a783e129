"""Big and absurd guests, with fake guest memory: a module of 30,000 symbols read in a few
reads, the ceilings on what a module claims (its name, symbols, text) and the line each cut
gives; a process of 65,530 mappings read in work that does not grow with the square of them, and
never walked whole inside a pause."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import replace

import pytest

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.arch.x86 import X86_64
from qmpprof.guest.linux import modules as modules_module
from qmpprof.guest.linux.modules import MAX_SYMBOLS, ModuleLayout, ModuleList
from qmpprof.memory import Reader
from qmpprof.pagecache import PAGE

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
        names = b"".join(b"f%d\0" % i for i in range(symbols))
        offsets = [names.index(b"\0f%d\0" % i) + 1 for i in range(1, symbols)]
        table = b"".join(
            struct.pack("<IBBHQQ", name, 2, 0, 1, text + 16 * i, 16)  # STT_FUNC
            for i, name in enumerate([0, *offsets])
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
