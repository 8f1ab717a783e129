"""The seeded fuzz test of the readers of untrusted bytes: thousands of damaged kernel images,
BTF and ORC sections, symbol maps, vmcoreinfo texts, cache entries, pprof profiles and guest
memories, built from Debian's 6.12 and 5.10 images and from synthetic inputs. Each reader
either reads the damage, ignores it where it promises to (the cache), or raises the project's
own error; any other exception fails the case, and the report names the seed that found it
(run it again with QMPPROF_FUZZ_SEED=N). The walks of guest memory must end
(``fuzzing.READ_LIMIT``)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import linuxkernel
import pytest
from fuzzing import GuestMemory, Mutator, seed
from guestvm import BUILD_ROOT as BUILD
from test_linux_arm64image import PACK, ZBOOT_NAMES, relr_image, small_image, zboot
from test_linux_bzimage import COMPRESSORS, FAKE_ELF, bzimage, size_append
from test_report_pprof import run_like_profile

from qmpprof.arch.x86 import X86_64
from qmpprof.elf.image import ElfImage
from qmpprof.errors import QmpprofError
from qmpprof.guest.linux.guest import Layouts
from qmpprof.guest.linux.modules import ModuleList
from qmpprof.guest.linux.pagetables import DIRECT_MAP_4, PageTables
from qmpprof.guest.linux.tasks import read_task, task_list
from qmpprof.guest.linux.vma import read_exec_vmas
from qmpprof.guest.linux.vmcoreinfo import check, parse, read_vmcoreinfo
from qmpprof.linux import cache
from qmpprof.linux.arm64image import elf_of_image
from qmpprof.linux.btf import Btf, BtfError
from qmpprof.linux.bzimage import vmlinux_bytes
from qmpprof.linux.kallsyms import read_kallsyms
from qmpprof.linux.kaslr import GATE, decode_idt, slide_from_gates
from qmpprof.linux.kernel import LinuxKernel, _orc
from qmpprof.linux.orc import numbering
from qmpprof.linux.symbols import parse_symbol_map
from qmpprof.naming import Naming
from qmpprof.output import native
from qmpprof.output.pprof import encode

SEED = seed()
KERNEL_HALF = 0xFFFF_8880_0000_0000  # the direct map: where task and module structs live
TEXT = 0xFFFF_FFFF_8100_0000


class Cases:
    """Runs cases, keeps the first few escapes, says the seed in every failure."""

    def __init__(self, name: str) -> None:
        self.rng = random.Random(f"{SEED}:{name}")
        self.mutator = Mutator(self.rng)
        self.count = 0
        self.escapes: list[str] = []

    def run(self, case: Callable[[], object], allowed: tuple[type[Exception], ...] = ()) -> None:
        self.count += 1
        try:
            case()
        except (QmpprofError, *allowed):
            pass
        except Exception as err:  # what the test is for: anything else escaping a reader
            if len(self.escapes) < 5:
                self.escapes.append(f"case {self.count}: {type(err).__name__}: {err}")

    def verdict(self, at_least: int) -> None:
        print(f"fuzz seed {SEED}: {self.count} cases")
        assert self.count >= at_least
        assert not self.escapes, f"seed {SEED} (QMPPROF_FUZZ_SEED={SEED}): {self.escapes}"


@pytest.fixture(scope="module")
def kernel() -> LinuxKernel:
    return LinuxKernel.load(linuxkernel.linux_dir("6.12") / "vmlinuz")


@pytest.fixture(scope="module")
def kernel_510() -> LinuxKernel:
    return LinuxKernel.load(linuxkernel.linux_dir("5.10") / "vmlinuz")


def test_damaged_bzimages_of_every_codec() -> None:
    cases = Cases("bzimage")
    for codec, pack in COMPRESSORS.items():
        image = bzimage(pack(FAKE_ELF) + size_append(FAKE_ELF))
        for _ in range(150):
            cases.run(partial(vmlinux_bytes, cases.mutator.mutate(image, edits=3), codec))
    cases.verdict(900)


def test_damaged_arm64_images_zboot_and_compressed() -> None:
    """A small Image with RELA and one with RELR relocations, and the first as an EFI zboot
    image and compressed whole, of every codec zboot uses, damaged anywhere (the header's
    offsets and codec name too)."""
    cases = Cases("arm64image")
    plain = small_image()
    for image in (plain, relr_image()):
        for _ in range(60):
            cases.run(partial(elf_of_image, cases.mutator.mutate(image, edits=3), "Image"))
    for codec in ZBOOT_NAMES:
        for packed in (zboot(plain, codec), PACK[codec](plain)):
            for _ in range(60):
                cases.run(partial(elf_of_image, cases.mutator.mutate(packed, edits=3), codec))
    cases.verdict(720)


def section_span(image: ElfImage, name: str) -> tuple[int, int]:
    header = image.section_header(name)
    assert header is not None
    return header.offset, header.offset + header.size


def headers_span(elf: bytes) -> tuple[int, int]:
    """Where an ELF64's section header table is."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    return shoff, shoff + shentsize * shnum


def test_damaged_elf_files(guest_build: None) -> None:
    """The bundled guest's kernel (symbols, .eh_frame, DWARF lines): its headers, section
    headers and those sections damaged, then read as a sample reads them."""
    data = (BUILD / "cfi" / "kernel.elf").read_bytes()
    image = ElfImage.from_bytes("kernel.elf", data)
    names = (".symtab", ".strtab", ".eh_frame", ".debug_line", ".debug_info", ".shstrtab")
    spans = [(0, 64), headers_span(data), *(section_span(image, name) for name in names)]
    pcs = range(image.text_addr, image.text_addr + image.text_size, 211)
    cases = Cases("elf")
    for _ in range(250):
        damaged = cases.mutator.mutate(data, cases.rng.choice(spans), edits=6)

        def read(damaged: bytes = damaged) -> None:
            elf = ElfImage.from_bytes("kernel.elf", damaged)
            elf.prepare()
            for pc in pcs:
                elf.symbols.lookup(pc)
                if elf.cfi is not None:
                    elf.cfi.row_for(pc)
            if elf.lines is not None:
                elf.lines.frames(pcs[len(pcs) // 2])

        cases.run(read)
    cases.verdict(250)


def kallsyms_span(kernel: LinuxKernel) -> tuple[int, int]:
    """The file offsets of the kallsyms tables in the image's .rodata (names to offsets)."""
    rodata = kernel.image.section_header(".rodata")
    first, last = kernel.address("kallsyms_num_syms"), kernel.address("kallsyms_relative_base")
    assert rodata is not None and first is not None and last is not None
    return rodata.offset + first - rodata.addr, rodata.offset + last + 8 - rodata.addr


def test_damaged_kallsyms_tables(kernel: LinuxKernel) -> None:
    """The image's kallsyms tables damaged, found and decoded as a load does (2 to 6 s each:
    the tables are searched for in all of .rodata when they do not check out)."""
    data = vmlinux_bytes((linuxkernel.linux_dir("6.12") / "vmlinuz").read_bytes())
    span = kallsyms_span(kernel)
    cases = Cases("kallsyms")
    for _ in range(3):
        damaged = cases.mutator.mutate(data, span, edits=12)
        cases.run(lambda damaged=damaged: read_kallsyms(ElfImage.from_bytes("vmlinux", damaged)))
    cases.verdict(3)


def test_damaged_images_load_as_one_error(kernel: LinuxKernel, tmp_path: Path) -> None:
    """Whole loads (``LinuxKernel.load``, 1 to 3 s each) of a vmlinux damaged in its headers, its
    section headers, its ORC tables, BTF or kallsyms: loaded, or one ElfError."""
    data = vmlinux_bytes((linuxkernel.linux_dir("6.12") / "vmlinuz").read_bytes())
    image = kernel.image
    spans = [(0, 64), headers_span(data), kallsyms_span(kernel),
             *(section_span(image, name) for name in (".orc_unwind_ip", ".orc_unwind")),
             (section_span(image, ".BTF")[0], section_span(image, ".BTF")[0] + 24)]  # fmt: skip
    cases = Cases("load")
    path = tmp_path / "vmlinux"
    for at in range(8):
        path.write_bytes(cases.mutator.mutate(data, spans[at % len(spans)], edits=4))
        cases.run(lambda: LinuxKernel.load(path))
    cases.verdict(8)


def test_damaged_btf_under_the_cached_index_leaves_notes(kernel: LinuxKernel) -> None:
    """The records of the structures a run reads (task, module, mm, maple tree), damaged with
    the index of the undamaged section, as a cached load has it; then the layouts as a run
    builds them. A damaged BTF may leave notes, never an exception."""
    assert kernel.btf is not None
    btf, data = kernel.btf, kernel.image.section(".BTF")
    assert data is not None
    spans = []
    for name in ("task_struct", "module", "mm_struct", "vm_area_struct", "maple_node", "file"):
        found = btf.struct(name)
        start = btf.index.starts[found.id]
        spans.append((start, start + 12 + 12 * found.vlen))
    cases = Cases("btf-layouts")
    for _ in range(400):
        damaged = cases.mutator.mutate(data, cases.rng.choice(spans), edits=6)

        def layouts(damaged: bytes = damaged) -> None:
            Layouts.of(replace(kernel, btf=Btf(damaged, btf.index)))

        cases.run(layouts, allowed=(BtfError,))  # Btf(...) itself: kernel._btf's note
    cases.verdict(400)


def every_type(btf: Btf) -> None:
    """Everything a reader asks of a type, of every type."""
    for type_id in range(1, len(btf) + 1):
        try:
            record = btf.resolve(type_id)
            btf.size_of(type_id)
            if record.kind.name in ("STRUCT", "UNION"):
                for member in btf.members(record.id):
                    btf.member(record.id, member.name or "absent")
        except KeyError:
            pass  # what a reader asks of the wrong kind of type: "this BTF lacks ..."


def test_damaged_small_btf_sections_read_from_scratch(kernel: LinuxKernel) -> None:
    """The first 400 types of Debian's BTF as a section of their own, damaged anywhere."""
    assert kernel.btf is not None
    data = kernel.image.section(".BTF")
    assert data is not None
    _, _, _, hdr_len, type_off, _, str_off, str_len = struct.unpack_from("<HBBIIIII", data)
    types = data[hdr_len + type_off : kernel.btf.index.starts[401]]
    strings = data[hdr_len + str_off : hdr_len + str_off + str_len]
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
    small = header + types + strings
    cases = Cases("btf-small")
    for _ in range(300):
        damaged = cases.mutator.mutate(small, (0, 24 + len(types)), edits=6)
        cases.run(lambda damaged=damaged: every_type(Btf(damaged)), allowed=(BtfError,))
    cases.verdict(300)


class Sections:
    """A kernel image as ``kernel._orc`` reads it: sections by name."""

    def __init__(self, path: str, sections: dict[str, tuple[int, bytes]]) -> None:
        self.path = path
        self.sections = sections

    def section(self, name: str) -> bytes | None:
        found = self.sections.get(name)
        return None if found is None else found[1]

    def section_addr(self, name: str) -> int | None:
        found = self.sections.get(name)
        return None if found is None else found[0]

    def section_header(self, name: str) -> None:
        return None


def test_damaged_orc_tables(kernel: LinuxKernel) -> None:
    """The first 2000 entries of Debian's ORC tables, damaged, one section or both."""
    ips = kernel.image.section(".orc_unwind_ip")
    entries = kernel.image.section(".orc_unwind")
    ip_addr = kernel.image.section_addr(".orc_unwind_ip")
    assert ips is not None and entries is not None and ip_addr is not None
    ips, entries = ips[: 4 * 2000], entries[: 6 * 2000]
    starts = list(kernel.functions.starts[:3000])
    cases = Cases("orc")
    for _ in range(300):
        damaged_ips = cases.mutator.mutate(ips) if cases.rng.randrange(2) else ips
        damaged = cases.mutator.mutate(entries, edits=20)
        image = Sections("vmlinux", {".orc_unwind_ip": (ip_addr, damaged_ips),
                                     ".orc_unwind": (0, damaged), ".rodata": (0, b"")})  # fmt: skip

        def read(image: Sections = image) -> None:
            table = _orc(image, None)  # type: ignore[arg-type]
            assert table is not None
            numbering(b"\0" * 20, table, starts)
            for pc in cases.rng.sample(starts, 50):
                with contextlib.suppress(ValueError):  # a type no kernel writes: "no rule"
                    table.lookup(pc)

        cases.run(read)
    cases.verdict(300)


def test_damaged_symbol_maps(kernel: LinuxKernel) -> None:
    symbols = kernel.symbols
    text = "".join(
        f"{symbols.addrs[i]:016x} {symbols.types[i]} {symbols.names[i]}\n" for i in range(2000)
    ).encode()
    cases = Cases("system.map")
    for _ in range(400):
        damaged = cases.mutator.mutate(text, edits=8).decode(errors="replace")
        cases.run(partial(parse_symbol_map, damaged, "System.map"))
    cases.verdict(400)


def test_damaged_vmcoreinfo_is_notes(kernel: LinuxKernel) -> None:
    text = (
        f"OSRELEASE=6.12\nPAGESIZE=4096\nSYMBOL(init_uts_ns)="
        f"{kernel.address('init_uts_ns', 0x1000000):x}\nKERNELOFFSET=1000000\n"
    ).encode()
    cases = Cases("vmcoreinfo")
    for _ in range(300):
        damaged = cases.mutator.mutate(text, edits=8).decode(errors="replace")
        cases.run(lambda damaged=damaged: check(parse(damaged), kernel, 0x1000000))
    cases.verdict(300)


@pytest.fixture
def cached_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: LinuxKernel) -> Path:
    """A small cache entry of every part: the first 500 symbols, a BTF index, ORC offsets."""
    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(tmp_path))
    symbols = kernel.symbols
    assert kernel.btf is not None and kernel.orc is not None
    few = type(symbols)(
        symbols.addrs[:500], symbols.types[:500], symbols.names[:500], symbols.modules[:500]
    )
    btf = kernel.btf.with_names(())
    index = cache.KernelIndex(
        1000,
        ([1, 2, 3], [2, 3, 4], [0, 1, 2]),
        cache.OrcIndex(TEXT, TEXT + 64, "signal", list(range(0, 64, 8))),
        type(btf)(btf.starts[:50], btf.kinds[:50], {4: {b"task_struct": 3}}),
    )
    cache.store("a" * 64, None, few, index)
    return cache.entry("a" * 64)


def test_damaged_cache_entries_are_ignored(cached_entry: Path) -> None:
    cases = Cases("cache")
    for name, load in (("symbols.bin", cache.load_symbols), ("index.bin", cache.load_index)):
        path = cached_entry / name
        good = path.read_bytes()
        assert load("a" * 64) is not None
        head = 4 + int.from_bytes(good[:4], "little")
        for _ in range(400):
            span = (0, head) if cases.rng.randrange(3) else None
            path.write_bytes(cases.mutator.mutate(good, span))
            cases.run(lambda load=load: load("a" * 64))  # None or an entry; never an exception
    cases.verdict(800)


def memory_cases(name: str, count: int) -> Iterator[tuple[Cases, GuestMemory]]:
    cases = Cases(name)
    for _ in range(count):
        yield cases, GuestMemory(cases.rng, (KERNEL_HALF, TEXT))
    cases.verdict(count)


def test_walks_of_random_guest_memory_end(kernel: LinuxKernel, kernel_510: LinuxKernel) -> None:
    """Tasks, modules, mappings (the maple tree of 6.12, the list of 5.10), page tables,
    vmcoreinfo and the IDT's gates, read from memory whose pointers loop: every walk ends,
    nothing escapes."""
    layouts, old = Layouts.of(kernel), Layouts.of(kernel_510)
    assert layouts.tasks and layouts.modules and layouts.vmas and old.vmas
    assert layouts.vmas.maple and not old.vmas.maple
    for cases, memory in memory_cases("guest-memory", 200):

        async def walks(memory: GuestMemory = memory) -> None:
            read, start = memory.read, memory.pointer()
            assert layouts.tasks and layouts.modules and layouts.vmas and old.vmas
            for task in (await task_list(read, start, layouts.tasks))[:8]:
                await read_task(read, task, layouts.tasks, KERNEL_HALF)
            await ModuleList(read, start, layouts.modules, kernel.orc, X86_64).refresh()
            await read_exec_vmas(read, start, layouts.vmas, 1 << 47)
            await read_exec_vmas(read, memory.pointer(), old.vmas, 1 << 47)
            tables = PageTables(read, DIRECT_MAP_4)
            await tables.physical(memory.pointer(), memory.rng.getrandbits(47))
            await read_vmcoreinfo(read, kernel, 0)
            (idt,) = await read([(memory.pointer(), 256 * GATE.size)])
            if idt is not None:  # the KASLR vote over the gates it holds
                slide_from_gates(decode_idt(idt), kernel.symbols, X86_64.shared_from)

        cases.run(lambda walks=walks: asyncio.run(walks()))


def test_damaged_pprof_profiles(tmp_path: Path) -> None:
    """A run's pprof (as report and diff read it), damaged before and after gzip."""
    data = encode(run_like_profile(), Naming())
    cases = Cases("pprof")
    path = tmp_path / "run.pb.gz"
    for _ in range(600):
        damaged = gzip.compress(cases.mutator.mutate(data, edits=6), mtime=0)
        if cases.rng.randrange(8) == 0:
            damaged = cases.mutator.mutate(damaged, edits=2)
        path.write_bytes(damaged)
        cases.run(lambda: native.load(path).named_counts(Naming()))
    cases.verdict(600)
