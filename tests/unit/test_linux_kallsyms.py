"""kallsyms of real kernels: Debian's 5.10, 6.1 and 6.12 and unstable's 7.x, checked against
their own export tables (and 7.x against its symbol table), a decoding the image contradicts
refused; and System.map / /proc/kallsyms text. (Hand-built tables: test_linux_kallsyms_layouts.)"""

from __future__ import annotations

import struct
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import linuxkernel
import pytest

from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError, SymbolMapError
from qmpprof.linux.bzimage import vmlinux_bytes
from qmpprof.linux.kallsyms import check_kallsyms, locate_kallsyms, read_kallsyms
from qmpprof.linux.symbols import KernelSymbols, parse_export_table, parse_symbol_map

LINUX_7 = linuxkernel.ROOT / "fixtures" / "build" / "linux-7"  # scripts/fetch-linux 7

# The real kernel, against an oracle of its own: the export table.


def exported(elf: ElfImage) -> dict[str, int]:
    """name -> address from __ksymtab and __ksymtab_gpl (7.x: one __ksymtab, the GPL flags in
    __kflagstab): struct kernel_symbol with CONFIG_HAVE_ARCH_PREL32_RELOCATIONS is three s32
    (value, name, namespace), each relative to its own address."""
    strings = elf.section("__ksymtab_strings")
    strings_addr = elf.section_addr("__ksymtab_strings")
    assert strings is not None and strings_addr is not None
    out = {}
    for section in ("__ksymtab", "__ksymtab_gpl"):
        data, addr = elf.section(section), elf.section_addr(section)
        if section != "__ksymtab" and data is None:
            continue
        assert data is not None and addr is not None and len(data) % 12 == 0
        for at in range(0, len(data), 12):
            value, name, _namespace = struct.unpack_from("<iii", data, at)
            start = addr + at + 4 + name - strings_addr
            text = strings[start : strings.index(b"\0", start)].decode()
            out[text] = (addr + at + value) & ((1 << 64) - 1)
    return out


@dataclass
class Kernel:
    series: str
    elf: ElfImage
    symbols: KernelSymbols


@pytest.fixture(scope="module", params=linuxkernel.SERIES)
def debian(request: pytest.FixtureRequest) -> Kernel:
    """Debian's 6.12 and 6.1 kernels, unpacked and their kallsyms decoded."""
    series: str = request.param
    elf = linuxkernel.vmlinux(series)
    return Kernel(series, elf, read_kallsyms(elf))


@pytest.fixture(scope="module")
def linux7() -> Kernel:
    """Debian unstable's 7.x from fixtures/build/linux-7 (fetched when missing: without it the
    tests fail, never skip), unpacked and its kallsyms decoded."""
    vmlinuz = LINUX_7 / "vmlinuz"
    if not vmlinuz.is_file():
        fetch = [linuxkernel.ROOT / "scripts" / "fetch-linux", "7"]
        done = subprocess.run(fetch, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0 or not vmlinuz.is_file():
            pytest.fail(f"{vmlinuz} is missing and scripts/fetch-linux 7 failed:\n{done.stderr}")
    elf = ElfImage.from_bytes(str(vmlinuz), vmlinux_bytes(vmlinuz.read_bytes(), str(vmlinuz)))
    return Kernel("7", elf, read_kallsyms(elf))


def check_exports(kernel: Kernel) -> None:
    """Every exported symbol, functions and variables (per-CPU ones included), is where
    kallsyms puts a symbol of its name."""
    exports = exported(kernel.elf)
    code = kernel.elf.code_ranges()
    assert sum(any(lo <= a < hi for lo, hi in code) for a in exports.values()) > 8000
    by_name: dict[str, set[int]] = {}
    for addr, name in zip(kernel.symbols.addrs, kernel.symbols.names, strict=True):
        by_name.setdefault(name, set()).add(addr)
    assert [n for n, a in exports.items() if a not in by_name.get(n, ())] == []


@pytest.mark.linux
def test_every_exported_symbol_has_its_kallsyms_address(debian: Kernel) -> None:
    check_exports(debian)


@pytest.mark.linux
def test_the_check_says_what_it_checked(debian: Kernel) -> None:
    """check_kallsyms (what scripts/check-kernels reports): the decoding read_kallsyms takes,
    where its tables are, and that every export was checked, none refused first."""
    checked = check_kallsyms(debian.elf)
    assert checked.symbols.addrs == debian.symbols.addrs
    assert checked.symbols.names == debian.symbols.names
    assert checked.exports == len(exported(debian.elf)) > 9000
    assert checked.refused == 0
    rodata, base = debian.elf.section(".rodata"), debian.elf.section_addr(".rodata")
    assert rodata is not None and base is not None
    assert checked.layout == locate_kallsyms(rodata, base)


@pytest.mark.linux
def test_debian_tables_are_whole_in_the_order_of_their_version(debian: Kernel) -> None:
    rodata = debian.elf.section(".rodata")
    base = debian.elf.section_addr(".rodata")
    assert rodata is not None and base is not None
    layout = locate_kallsyms(rodata, base)
    if debian.series == "7":  # offsets after the token index, relative to themselves: no base
        assert layout.names < layout.markers < layout.token_table < layout.offsets
        assert layout.relative_base is None and not layout.absolute_percpu
    elif debian.series == "6.12":  # 6.4 on: offsets and base after the token index
        assert layout.names < layout.markers < layout.token_table < layout.offsets
    else:  # before: offsets and base first (6.1: seqs of names between markers and tokens)
        assert layout.offsets < layout.names < layout.markers < layout.token_table
        markers_end = layout.markers + 4 * ((layout.count + 255) // 256)
        if debian.series == "6.1":
            assert layout.token_table - markers_end >= 3 * layout.count
        else:  # 5.10: the token table follows the markers (aligned)
            assert 0 <= layout.token_table - markers_end < 256
    if debian.series != "7":
        assert layout.relative_base is not None and layout.absolute_percpu
    symbols = debian.symbols
    assert len(symbols) == layout.count > 90_000
    assert symbols.addrs == sorted(symbols.addrs)
    text = symbols.text_symbols()
    assert len(text) > 45_000
    code = debian.elf.code_ranges()
    assert sum(any(lo <= s.addr < hi for lo, hi in code) for s in text) >= 0.99 * len(text)
    for name in ("startup_64", "do_syscall_64", "schedule", "entry_SYSCALL_64", "start_kernel"):
        assert symbols.types[symbols.names.index(name)] in "tT", name
    table = symbols.symbol_table()
    schedule = symbols.address_of("schedule")
    assert schedule is not None and table.lookup(schedule + 3) == ("schedule", 3)


@pytest.mark.linux
def test_debian_system_map_is_a_stub_and_says_so(linux_dir: Path) -> None:
    with pytest.raises(SymbolMapError, match=r"stub System\.map"):
        parse_symbol_map((linux_dir / "System.map").read_text(), "System.map")


@pytest.mark.linux
def test_kallsyms_text_of_the_decode_parses_back(debian: Kernel) -> None:
    symbols = debian.symbols
    rows = zip(symbols.addrs, symbols.types, symbols.names, strict=True)
    again = parse_symbol_map("".join(f"{a:016x} {t} {n}\n" for a, t, n in rows))
    assert (again.addrs, again.types, again.names) == (
        symbols.addrs,
        symbols.types,
        symbols.names,
    )


@pytest.mark.linux
def test_per_cpu_symbols_are_offsets_in_a_zero_based_area_up_to_6_12(debian: Kernel) -> None:
    """x86_64 up to 6.12 links .data..percpu at 0: its symbols are absolute offsets (``A``)
    from __per_cpu_start = 0 to __per_cpu_end = the section's size, below all others. (7.x
    links it with the rest of the kernel's data: test_linux_7_tables_have_no_base_and_...)"""
    section = debian.elf.section_header(".data..percpu")
    symbols = debian.symbols
    if debian.series == "7":
        assert section is not None and section.addr == symbols.address_of("__per_cpu_start")
        return
    assert section is not None and section.addr == 0
    assert symbols.address_of("__per_cpu_start") == 0
    assert symbols.address_of("__per_cpu_end") == section.size
    below = [t for a, t in zip(symbols.addrs, symbols.types, strict=True) if a < section.size]
    assert len(below) > 300 and set(below) == {"A"}


@pytest.mark.linux
def test_a_decoding_the_image_contradicts_is_refused() -> None:
    """6.12's tables made to lie: a relative base moved by 2 MiB puts _text off the start of
    .text, an export moved by 16 bytes is not where kallsyms has it. Both fail the load."""
    elf = linuxkernel.vmlinux("6.12")
    rodata = elf.section_header(".rodata")
    ksymtab = elf.section_header("__ksymtab")
    assert rodata is not None and ksymtab is not None
    data = elf.file_bytes(0, elf.size)
    layout = locate_kallsyms(data[rodata.offset : rodata.offset + rodata.size], rodata.addr)
    assert layout.relative_base is not None
    at = rodata.offset + layout.relative_base
    (base,) = struct.unpack_from("<Q", data, at)
    moved = data[:at] + struct.pack("<Q", base + 0x200000) + data[at + 8 :]
    with pytest.raises(KernelImageError, match=r"_text is at 0xffffffff81200000, not at the"):
        read_kallsyms(ElfImage.from_bytes("moved", moved))
    at = ksymtab.offset + 12 * 100
    (value,) = struct.unpack_from("<i", data, at)
    moved = data[:at] + struct.pack("<i", value + 16) + data[at + 4 :]
    with pytest.raises(KernelImageError, match=r"1 of \d+ exported symbols are not where"):
        read_kallsyms(ElfImage.from_bytes("moved", moved))


# Debian unstable's 7.x: tables 4-aligned (the names 4 bytes after the count), offsets relative
# to themselves with no base, per-CPU symbols at ordinary addresses.


@pytest.mark.linux
def test_linux_7_tables_have_no_base_and_per_cpu_symbols_are_kernel_data(linux7: Kernel) -> None:
    rodata, base = linux7.elf.section(".rodata"), linux7.elf.section_addr(".rodata")
    assert rodata is not None and base is not None
    layout = locate_kallsyms(rodata, base)
    assert layout.relative_base is None and not layout.absolute_percpu
    assert layout.names == layout.num_syms + 4
    assert layout.num_syms < layout.names < layout.markers < layout.token_table < layout.offsets
    symbols = linux7.symbols
    assert len(symbols) == layout.count > 150_000
    assert symbols.address_of("_text") == linux7.elf.text_addr
    section = linux7.elf.section_header(".data..percpu")
    assert section is not None and section.addr >= 0xFFFF_8000_0000_0000
    assert symbols.address_of("__per_cpu_start") == section.addr
    assert symbols.address_of("__per_cpu_end") == section.addr + section.size
    current = symbols.address_of("current_task")
    assert current is not None and section.addr <= current < section.addr + section.size
    assert min(symbols.addrs) >= 0xFFFF_8000_0000_0000  # nothing zero-based
    check_exports(linux7)


@pytest.mark.linux
def test_linux_7_symbols_are_its_own_symbol_table(linux7: Kernel) -> None:
    """Against the -dbg vmlinux's .symtab (every decoded symbol there at its address, every
    function decoded) or else a real System.map (equal, less the absolute symbols kallsyms
    leaves out)."""
    symbols = linux7.symbols
    decoded = Counter(zip(symbols.addrs, symbols.types, symbols.names, strict=True))
    dbg, system_map = LINUX_7 / "vmlinux-dbg", LINUX_7 / "System.map"
    if dbg.is_file():
        named, functions = symtab(ElfImage.load(dbg, mapped=True))
        assert Counter((a, n) for a, _, n in decoded.elements()) - named == Counter()
        assert functions - Counter((a, n) for a, _, n in decoded.elements()) == Counter()
        assert len(functions) > 100_000
        return
    try:
        reference = parse_symbol_map(system_map.read_text(), str(system_map))
    except (OSError, SymbolMapError) as err:
        pytest.fail(f"{LINUX_7} has no vmlinux-dbg and no real System.map to compare with: {err}")
    rows = zip(reference.addrs, reference.types, reference.names, strict=True)
    assert decoded == Counter(row for row in rows if row[1] not in "aA")


def symtab(elf: ElfImage) -> tuple[Counter[tuple[int, str]], Counter[tuple[int, str]]]:
    """(address, name) of every defined named symbol of an ELF's .symtab, and of its functions
    (Elf64_Sym: name, info, other, shndx, value, size)."""
    header, data = elf.section_header(".symtab"), elf.section(".symtab")
    assert header is not None and data is not None
    names = elf.section_header(".strtab")
    assert names is not None
    strtab = elf.file_bytes(names.offset, names.size)
    named: Counter[tuple[int, str]] = Counter()
    functions: Counter[tuple[int, str]] = Counter()
    for name, info, _, shndx, value, _ in struct.iter_unpack("<IBBHQQ", data):
        if name and shndx:
            row = (value, strtab[name : strtab.index(b"\0", name)].decode())
            named[row] += 1
            if info & 0xF == 2:  # STT_FUNC
                functions[row] += 1
    return named, functions


# System.map and /proc/kallsyms text.


def test_proc_kallsyms_lines_with_modules() -> None:
    text = (
        "ffffffffc0a01000 t ext4_fill_super\t[ext4]\n"
        "ffffffff81000000 T _stext\n"
        "ffffffff81000000 T _text\n"
        "not a symbol line\n"
        "ffffffff81000100 T schedule\n"
        "ffffffffc0a01100 T ext4_iget\t[ext4]\n"
    )
    symbols = parse_symbol_map(text, "kallsyms")
    assert symbols.names == ["_stext", "_text", "schedule", "ext4_fill_super", "ext4_iget"]
    assert symbols.modules == [None, None, None, "ext4", "ext4"]
    assert symbols.address_of("ext4_iget") is None
    assert symbols.address_of("ext4_iget", "ext4") == 0xFFFFFFFFC0A01100
    assert symbols.symbol_table().lookup(0xFFFFFFFF81000010) == ("_stext", 0x10)
    ext4 = symbols.symbol_table("ext4")
    assert ext4.lookup(0xFFFFFFFFC0A01008) == ("ext4_fill_super", 8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no 'ADDRESS TYPE NAME' lines"),
        ("0000000000000000 T _stext\n0000000000000000 T schedule\n", "every address is 0"),
    ],
)
def test_unusable_symbol_maps_say_why(text: str, message: str) -> None:
    with pytest.raises(SymbolMapError, match=message) as caught:
        parse_symbol_map(text, "map")
    assert str(caught.value).startswith("map: not a usable symbol map: ")


def test_export_table_entries_are_relative_to_themselves() -> None:
    """Three s32 an entry (value, name, namespace), each relative to its own address; a name
    may be the tail of a longer one (merged strings); an exported per-CPU variable's value is
    its offset, reached modulo 2**64."""
    strings_addr, entries_addr = 0xFFFFFFFF82900000, 0xFFFFFFFF82800000
    strings = b"\0ns\0do_schedule\0"  # "schedule" is the tail of "do_schedule" (at 7)

    def entry(at: int, target: int, name: int) -> bytes:
        place = entries_addr + at
        fields = (target - place, strings_addr + name - place - 4, strings_addr + 1 - place - 8)
        return struct.pack("<3i", *((f + (1 << 31)) % (1 << 64) - (1 << 31) for f in fields))

    table = entry(0, 0xFFFFFFFF81000100, 4) + entry(12, 0xFFFFFFFF81000200, 7)
    table += entry(24, 0x1FB80, 1)
    assert parse_export_table(table, entries_addr, strings, strings_addr) == [
        ("do_schedule", 0xFFFFFFFF81000100),
        ("schedule", 0xFFFFFFFF81000200),
        ("ns", 0x1FB80),
    ]
    outside = entry(0, 0xFFFFFFFF81000100, 0x1000)
    assert parse_export_table(outside, entries_addr, strings, strings_addr) is None
    assert parse_export_table(table[:-4], entries_addr, strings, strings_addr) is None


def test_a_name_is_found_at_any_of_its_addresses() -> None:
    symbols = KernelSymbols([0x10, 0x20, 0x20], ["t", "t", "T"], ["show", "init", "show"])
    assert symbols.address_of("show") == 0x10
    assert symbols.has("show", 0x20) and symbols.has("show", 0x10)
    assert not symbols.has("init", 0x10) and not symbols.has("exit", 0x20)
