"""The seeded fuzz test of the readers of untrusted bytes: thousands of damaged kernel images,
BTF and ORC sections, symbol maps, vmcoreinfo texts, cache entries, .qmpprof files (versions 1
and 2), pprof profiles, serve's TOML settings and guest memories, built from Debian's 6.1,
6.12, 7.x and 5.10 images and from synthetic inputs. Each reader either reads the damage,
ignores it where it promises to (the cache), or raises the project's own error; any other
exception fails the case, and the report names the seed that found it (run it again with
QMPPROF_FUZZ_SEED=N). Each reader's cases must get past its first check often enough (a floor
on ``Cases.deep``); the kallsyms search and the readers of files a user passes around must end
each case within ``fuzzing.CPU_LIMIT`` (2 s of CPU) and ``fuzzing.MEMORY_LIMIT`` (128 MiB: the
rise of the resident set at its peak). The walks of guest memory must end
(``fuzzing.READ_LIMIT``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import json
import random
import struct
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import fuzzing
import linuxkernel
import pytest
from fuzzing import Cases, GuestMemory, Mutator, seed
from guestvm import BUILD_ROOT as BUILD
from kernelpack import COMPRESSORS, PACK, ZBOOT_NAMES, size_append, zboot
from protowire import Message, fields
from test_linux_arm64image import relr_image, small_image
from test_linux_bzimage import FAKE_ELF, bzimage
from test_report_pprof import run_like_profile

from qmpprof.arch.x86 import X86_64
from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError
from qmpprof.linux import cache
from qmpprof.linux.aarch64.kernelimage import elf_of_image
from qmpprof.linux.btf import Btf, BtfError
from qmpprof.linux.bzimage import vmlinux_bytes
from qmpprof.linux.kallsyms import check_kallsyms, read_kallsyms
from qmpprof.linux.kallsymtables import LONG_RUN, decodings
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.guest import Layouts
from qmpprof.linux.running.modules import ModuleList
from qmpprof.linux.running.pagetables import DIRECT_MAP_4, PageTables
from qmpprof.linux.running.tasks import read_task, task_list
from qmpprof.linux.running.vma import read_exec_vmas
from qmpprof.linux.running.vmcoreinfo import check, parse, read_vmcoreinfo
from qmpprof.linux.symbols import parse_symbol_map
from qmpprof.linux.x86_64.idt import GATE, decode_idt, slide_from_gates
from qmpprof.linux.x86_64.kernelfile import _orc
from qmpprof.linux.x86_64.orctables import numbering
from qmpprof.linux.x86_64.running import X86_64 as X86_64_LINUX
from qmpprof.model import NO_CPU, Frame, Mode, Sample, Stack, StopReason
from qmpprof.naming import Detail, Naming
from qmpprof.output import FORMATS, diff, native, render
from qmpprof.output.pprof import encode
from qmpprof.profile import Profile
from qmpprof.serve import config

SEED = seed()
KERNEL_HALF = 0xFFFF_8880_0000_0000  # the direct map: where task and module structs live
TEXT = 0xFFFF_FFFF_8100_0000
RENDERED = 1 << 12  # samples of a loaded profile at most, for its case to write it too


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


def kallsyms_damage(rng: random.Random, data: bytes, span: tuple[int, int]) -> bytes:
    """The damage that once kept the search going for minutes: 2 bytes put in, a run of digits
    written over the tables, a marker word set to all ones; or any (``Mutator``)."""
    kind, at = rng.randrange(4), rng.randrange(*span)
    if kind == 0:
        return data[:at] + rng.randbytes(2) + data[at:]
    if kind == 1:
        digits = bytes(rng.choice(b"0123456789") for _ in range(rng.randint(2, 40)))
        return data[:at] + digits + data[at + len(digits) :]
    if kind == 2:
        at -= at % 4
        return data[:at] + b"\xff" * 4 + data[at + 4 :]
    return Mutator(rng).mutate(data, span, edits=12)


@pytest.mark.parametrize("series", ["6.1", "6.12", "7"])
def test_damaged_kallsyms_tables(series: str) -> None:
    """The image's kallsyms tables damaged, found and decoded as a load does: found, or one
    line, within the CPU limit (the search counts its steps)."""
    data = vmlinux_bytes((linuxkernel.linux_dir(series) / "vmlinuz").read_bytes())
    image = ElfImage.from_bytes("vmlinux", data)
    layout = check_kallsyms(image).layout
    rodata = image.section_header(".rodata")
    assert rodata is not None
    places = (layout.num_syms, layout.names, layout.markers, layout.token_table, layout.offsets)
    span = rodata.offset + min(places), rodata.offset + max(places)
    cases = Cases(f"kallsyms-{series}", ("no token table found",), limits=True)  # CPU only
    for _ in range(3):
        damaged = kallsyms_damage(cases.rng, data, span)
        cases.run(lambda damaged=damaged: read_kallsyms(ElfImage.from_bytes("vmlinux", damaged)))
    cases.verdict(3, deep=3)


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
    cached = LinuxKernel.load(kernel.path)  # the fixture's load filled the cache
    assert cached.btf is not None and cached.btf.index.names  # names indexed, as cached
    btf, data = cached.btf, cached.image.section(".BTF")
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
            Layouts.of(replace(cached, btf=Btf(damaged, btf.index)))

        cases.run(layouts, allowed=(BtfError,))  # Btf(...) itself: kernel._btf's note
    cases.verdict(400)


def every_type(btf: Btf) -> int:
    """Everything a reader asks of a type, of every type; how many types answered it all.
    Only what Btf documents for damage is taken as an answer: KeyError from ``resolve`` (a chain
    to an id no type has) and ``size_of`` (a type of no size). A struct's members, and each of
    them by its name, must then be read."""
    whole = 0
    for type_id in range(1, len(btf) + 1):
        try:
            record = btf.resolve(type_id)
            btf.size_of(type_id)
        except KeyError:
            continue
        if record.kind.name in ("STRUCT", "UNION"):
            for member in btf.members(record.id):
                if member.name:
                    btf.member(record.id, member.name)
        whole += 1
    return whole


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
    whole = 0
    for _ in range(300):
        damaged = cases.mutator.mutate(small, (0, 24 + len(types)), edits=6)

        def read(damaged: bytes = damaged) -> None:
            nonlocal whole
            whole += every_type(Btf(damaged))

        cases.run(read, allowed=(BtfError,))
    cases.verdict(300, deep=200)
    assert whole >= 300 * 100  # types read whole: the damage left most of them readable


class Sections:
    """A kernel image as ``x86_64.kernelfile._orc`` reads it: sections by name."""

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
    assert kernel.btf is not None and kernel.tables is not None
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
    for cases, memory in memory_cases("guest-memory", 1000):

        async def walks(memory: GuestMemory = memory) -> None:
            read, start = memory.read, memory.pointer()
            assert layouts.tasks and layouts.modules and layouts.vmas and old.vmas
            for task in (await task_list(read, start, layouts.tasks))[:8]:
                await read_task(read, task, layouts.tasks, KERNEL_HALF)
            steps = functools.partial(X86_64_LINUX.module_steps, kernel, X86_64)
            await ModuleList(read, start, layouts.modules, steps, X86_64).refresh()
            await read_exec_vmas(read, start, layouts.vmas, 1 << 47)
            await read_exec_vmas(read, memory.pointer(), old.vmas, 1 << 47)
            tables = PageTables(read, DIRECT_MAP_4)
            await tables.physical(memory.pointer(), memory.rng.getrandbits(47))
            await read_vmcoreinfo(read, kernel, 0)
            (idt,) = await read([(memory.pointer(), 256 * GATE.size)])
            if idt is not None:  # the KASLR vote over the gates it holds
                slide_from_gates(decode_idt(idt), kernel.symbols, X86_64.shared_from)

        cases.run(lambda walks=walks: asyncio.run(walks()))


def off_cpu_profile() -> Profile:
    """A run's profile (``run_like_profile``) with a task off CPU, which version 2 keeps."""
    profile = run_like_profile()
    stack = Stack(tuple(profile.frames_of(profile.stacks[1])), StopReason.END)
    shell = profile.stacks[1].process
    profile.add(Sample(0.05, NO_CPU, Mode.USER, True, 0, stack, shell, "S"))
    return profile


def report(path: Path) -> None:
    """What ``qmpprof report`` and ``qmpprof diff`` do with a file: load it, write every format,
    compare it with itself. Writing is not reading: a damaged count may claim millions of
    samples, which load within the limits but take seconds to write, so those are only loaded."""
    profile = native.load(path)
    if len(profile) > RENDERED:
        return
    for fmt in FORMATS:
        render(profile, fmt, Naming(Detail.LINE))
    diff.render_svg(profile, profile, Naming(), ("a", "b"))
    diff.render_folded(profile, profile, Naming())


def qmpprof_text(rng: random.Random, doc: dict[str, object]) -> bytes:
    """The document damaged as a value (most cases), as text, or nested deep."""
    kind = rng.randrange(8)
    if kind == 0:
        text = json.dumps(doc).encode()
        return Mutator(rng).mutate(text, edits=4)
    if kind == 1:
        return json.dumps(doc)[:-1].encode() + b',"deep":' + fuzzing.nested(100_000).encode() + b"}"
    return json.dumps(fuzzing.mutate_json(rng, doc)).encode()


@pytest.mark.parametrize("version", [1, 2])
def test_damaged_qmpprof_files(version: int, tmp_path: Path) -> None:
    """A run's .qmpprof (version 1: stacks of four fields; 2: a state off CPU), damaged as
    JSON values (odd numbers, types, lone surrogates, lists cut or repeated), as bytes, nested
    deep, or packed with white space before or in it, then reported as ``report`` and ``diff``
    do."""
    doc = json.loads(gzip.decompress(render(off_cpu_profile(), "qmpprof")))
    if version == 1:
        doc["version"] = 1
        doc["stacks"] = [stack[:4] for stack in doc["stacks"]]
    cases = Cases(f"qmpprof-{version}", ("not gzipped", "no qmpprof profile header"), True, True)
    path = tmp_path / "run.qmpprof"
    for _ in range(1000):
        text = qmpprof_text(cases.rng, doc)
        if cases.rng.randrange(50) == 0:  # unpacked but not kept: before the JSON or in it
            at = cases.rng.choice((0, cases.rng.randrange(len(text))))
            text = text[:at] + b" " * (8 << 20) + text[at:]
        path.write_bytes(gzip.compress(text, mtime=0))
        cases.run(lambda: report(path))
    cases.verdict(1000, deep=600)


def test_damaged_pprof_profiles(tmp_path: Path) -> None:
    """A run's pprof (as report and diff read it), damaged as bytes or field by field (odd
    numbers and strings, fields dropped or repeated), and after gzip; one in twenty gains a
    field repeated 10,000 times, or a sample counting 2**63."""
    data = encode(off_cpu_profile(), Naming())
    sample = next(bytes(v) for n, _, v in fields(data) if n == 2 and isinstance(v, bytes))
    first = ("not gzipped", "runs past the end", "wire type", "no sample types")
    cases = Cases("pprof", first, limits=True, memory=True)
    path = tmp_path / "run.pb.gz"
    for at in range(1000):
        if at % 2:
            damaged = cases.mutator.mutate(data, edits=6)
        else:
            damaged = fuzzing.mutate_proto(cases.rng, data)
        if at % 20 == 0:
            repeated = Message().raw(2, sample).encode() * 10_000
            huge = Message().raw(2, Message().packed(1, [1]).packed(2, [1 << 63]).encode())
            damaged += repeated if at % 40 else huge.encode()
        packed = gzip.compress(damaged, mtime=0)
        if cases.rng.randrange(8) == 0:
            packed = cases.mutator.mutate(packed, edits=2)
        path.write_bytes(packed)
        cases.run(lambda: report(path))
    cases.verdict(1000, deep=350)


CONFIG = b"""[vm.web1]
socket = "/run/qemu/web1.qmp"
kernel = "/boot/vmlinuz-6.12.57"
kallsyms = "System.map-6.12.57"
user_dir = "rootfs/web1"
os = "linux"
interval = 50
max_overhead = 1
off_cpu = true

[vm.db]
interval = 10.5
max_overhead = "none"
"""


def toml_text(rng: random.Random) -> bytes:
    """serve's settings damaged: as bytes, a value made odd, nested deep, not UTF-8."""
    kind = rng.randrange(6)
    lines = CONFIG.splitlines(keepends=True)
    at = rng.randrange(len(lines))
    if kind == 0:
        return Mutator(rng).mutate(CONFIG, edits=4)
    if kind == 1:
        lines.insert(at, b"deep = " + fuzzing.nested(rng.choice((100, 100_000))).encode() + b"\n")
    elif kind == 2:
        lines.insert(at, b"t = " + b"{a = " * 50_000 + b"1" + b"}" * 50_000 + b"\n")
    elif kind == 3:
        lines[at] = lines[at][:-2] + bytes([rng.randrange(0x80, 0x100)]) + b"\n"
    else:
        key, _, _ = lines[at].partition(b" = ")
        odd = rng.choice(("inf", "nan", "-0.0", "1e+305", "9223372036854776.0",
                          '"~nobody-here/x"', '"~/x"', '""', "[]", "{}", "2000-01-01"))  # fmt: skip
        lines[at] = (key.strip() or b"interval") + b" = " + odd.encode() + b"\n"
    return b"".join(lines)


def test_damaged_serve_settings(tmp_path: Path) -> None:
    """serve's ``--config`` and ``NAME.toml`` files damaged, then read: settings, or one
    UsageError naming the file."""
    cases = Cases("toml", ("not TOML",), limits=True, memory=True)
    path = tmp_path / "vms.toml"
    for at in range(1000):
        path.write_bytes(toml_text(cases.rng))
        read = config.read_config if at % 2 else config.read_beside
        cases.run(lambda read=read: read(path))
    cases.verdict(1000, deep=250)


def test_white_space_before_a_profile_is_unpacked_not_kept(tmp_path: Path) -> None:
    """64 MiB of spaces before a .qmpprof's JSON (64 KiB packed): it loads, the same as
    without them, and the load's peak stays near the 4 MiB pieces it unpacks."""
    profile = off_cpu_profile()
    path = tmp_path / "run.qmpprof"
    text = gzip.decompress(render(profile, "qmpprof"))
    path.write_bytes(gzip.compress(b" " * (64 << 20) + text, mtime=0))
    tracemalloc.start()
    try:
        again = native.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert list(again.timeline()) == list(profile.timeline())
    assert peak < 16 << 20


def test_white_space_in_a_profile_is_unpacked_not_kept(tmp_path: Path) -> None:
    """A .qmpprof written with a newline and indent before every value, 64 MiB of spaces
    inside its samples and a fact whose spaces, tab and quotes are its own: it loads the same
    as it was written (the fact's white space kept), and the load's peak stays near the 4 MiB
    pieces it unpacks."""
    profile = off_cpu_profile()
    profile.facts["note"] = 'two  spaces,\ta tab, " a quote, \\ a backslash'
    doc = json.loads(gzip.decompress(render(profile, "qmpprof")))
    head, tail = json.dumps(doc, indent=2, ensure_ascii=False).split('"samples": {', 1)
    text = f'{head}"samples": {{{" " * (64 << 20)}\n{tail}'.encode()
    path = tmp_path / "run.qmpprof"
    path.write_bytes(gzip.compress(text, mtime=0))
    tracemalloc.start()
    try:
        again = native.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert again.facts == profile.facts
    assert list(again.timeline()) == list(profile.timeline())
    assert peak < 16 << 20


def test_the_kallsyms_search_ends_within_its_steps(kernel: LinuxKernel) -> None:
    """A search given fewer steps than the image's tables take gives up with one line; the
    default finds them."""
    rodata = kernel.image.section(".rodata")
    base = kernel.image.section_addr(".rodata")
    assert rodata is not None and base is not None
    with pytest.raises(KernelImageError, match="within 100,000 steps of search"):
        next(decodings(rodata, base, "vmlinux", LONG_RUN, steps=100_000))
    _, symbols = next(decodings(rodata, base, "vmlinux", LONG_RUN))
    assert symbols.names == kernel.symbols.names[: len(symbols.names)]


def test_a_lone_surrogate_in_a_name_renders_in_every_format(tmp_path: Path) -> None:
    """A symbol holding a lone surrogate (from guest bytes, or escaped in a .qmpprof): every
    format is written, with "?" (or the SVG's U+FFFD) in its place, and it reads back as U+FFFD."""
    profile = Profile()
    frame = Frame(0x40_1000, False, "bad\ud800name", 0)
    profile.add(Sample(0.0, 0, Mode.USER, True, 0, Stack((frame,)), None))
    for fmt in FORMATS:
        out = render(profile, fmt, Naming())
        if not FORMATS[fmt].binary:
            assert b"bad?name" in out or "bad\ufffdname".encode() in out
    path = tmp_path / "run.qmpprof"
    path.write_bytes(render(profile, "qmpprof"))
    assert native.load(path).frames[0].symbol == "bad\ufffdname"
