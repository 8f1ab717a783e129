"""kallsyms: hand-built tables in every layout the kernel has used, the real Debian kernel
checked against its own export table, and System.map / /proc/kallsyms text."""

from __future__ import annotations

import random
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import linuxkernel
import pytest

from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError, SymbolMapError
from qmpprof.linux.kallsyms import decode_kallsyms, locate_kallsyms, read_kallsyms
from qmpprof.linux.symbols import KernelSymbols, parse_symbol_map

BASE = 0xFFFFFFFF82000000  # where the hand-built .rodata is loaded
TEXT = 0xFFFFFFFF81000000


# A small scripts/kallsyms, written from the format: tokens, names, markers, offsets.


def some_symbols(
    count: int = 700, percpu: bool = True, long_name: int = 300
) -> list[tuple[int, str, str]]:
    """(address, type, name), sorted: per-CPU symbols at 0 up, text, then data; one name of
    ``long_name`` random characters, too long to compress below 0x80 codes."""
    rng = random.Random(7)
    out: list[tuple[int, str, str]] = []
    if percpu:
        out += [(0, "A", "fixed_percpu_data"), (0x1000, "A", "cpu_tss_rw"), (0x3510, "A", "hot")]
    addr = TEXT
    out += [(addr, "T", "_stext"), (addr, "T", "_text"), (addr, "T", "startup_64")]
    fixed = ["schedule", "start_kernel", "do_syscall_64", "x" * 40 + "_long"]
    random_name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(long_name))
    for i in range(count):
        addr += rng.choice((0x10, 0x40, 0x130))
        name = fixed[i] if i < len(fixed) else f"func_{i}_{rng.randrange(10**6)}"
        if i == 300:
            name = random_name
        out.append((addr, rng.choice("tTtTW"), name))
    addr = 0xFFFFFFFF82C00000
    for i in range(count // 4):
        addr += 8
        out.append((addr, rng.choice("dDbBr"), f"var_{i}"))
    return out


def make_tokens(texts: list[str]) -> list[str]:
    """Codes used as themselves keep their character; the others get frequent substrings."""
    used = {ord(c) for text in texts for c in text}
    assert max(used) < 256 and {ord(d) for d in "0123456789"} <= used
    grams = Counter(t[i : i + n] for t in texts for n in (2, 3, 5) for i in range(len(t) - n + 1))
    spare = iter(gram for gram, _ in grams.most_common())
    return [chr(code) if code in used else next(spare) for code in range(256)]


def encode(text: str, tokens: list[str]) -> bytes:
    """Greedy longest match: any encoding expands back to the text, which is all that counts."""
    by_len = sorted(range(256), key=lambda code: -len(tokens[code]))
    out = bytearray()
    pos = 0
    while pos < len(text):
        code = next(c for c in by_len if text.startswith(tokens[c], pos))
        out.append(code)
        pos += len(tokens[code])
    return bytes(out)


@dataclass
class Built:
    data: bytes
    labels: dict[str, int]


class Rodata:
    """Bytes being laid out at BASE, every label aligned to 8 as scripts/kallsyms' ALGN."""

    def __init__(self, junk: bytes) -> None:
        self.data = bytearray(junk)
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> int:
        self.data += b"\0" * (-len(self.data) % 8)
        self.labels[name] = len(self.data)
        return len(self.data)

    def emit(self, name: str, blob: bytes) -> None:
        self.label(name)
        self.data += blob


def build(
    symbols: list[tuple[int, str, str]],
    order: str,
    mode: str,
    seq_width: int = 3,
    wide: bool = True,
) -> Built:
    texts = [kind + name for _, kind, name in symbols]
    tokens = make_tokens(texts)
    names, markers = bytearray(), []
    for i, text in enumerate(texts):
        if i % 256 == 0:
            markers.append(len(names))
        code = encode(text, tokens)
        if len(code) < 0x80 or not wide:
            names.append(len(code))
        else:
            names += bytes([(len(code) & 0x7F) | 0x80, len(code) >> 7])
        names += code
    token_table = b"".join(t.encode("latin-1") + b"\0" for t in tokens)
    index, at = [], 0
    for t in tokens:
        index.append(at)
        at += len(t) + 1
    count = len(symbols)
    by_name = sorted(range(count), key=lambda i: symbols[i][2])
    seqs = b"".join(
        i.to_bytes(3, "big") if seq_width == 3 else struct.pack("<I", i) for i in by_name
    )
    absolute = [kind == "A" for _, kind, _ in symbols]
    relative_base = next(a for (a, _, _), ab in zip(symbols, absolute, strict=True) if not ab)
    if mode == "relative":
        relative_base = symbols[0][0]

    def offsets(at: int) -> bytes:
        values = []
        for i, (addr, _, _) in enumerate(symbols):
            if mode == "pcrel":
                values.append(addr - (BASE + at + 4 * i))
            elif mode == "relative":
                values.append(
                    addr - relative_base - (1 << 32 if addr - relative_base >= 1 << 31 else 0)
                )
            else:
                values.append(addr if absolute[i] else relative_base - addr - 1)
        return struct.pack(f"<{count}i", *values)

    out = Rodata(random.Random(1).randbytes(1000) + b"\0" * 333)
    head = [("num_syms", struct.pack("<I", count)), ("names", bytes(names))]
    head.append(("markers", struct.pack(f"<{len(markers)}I", *markers)))
    tokens_part = [("token_table", token_table), ("token_index", struct.pack("<256H", *index))]
    base_part = [] if mode == "pcrel" else [("relative_base", struct.pack("<Q", relative_base))]
    if order == "new":
        parts = [*head, *tokens_part]
    else:
        parts = [("offsets", b""), *base_part, *head]
        if order == "seqs":
            parts.append(("seqs", seqs))
        parts += tokens_part
    for name, blob in parts:
        if name == "offsets":
            out.emit(name, offsets(out.label(name)))
        else:
            out.emit(name, blob)
    if order == "new":
        out.emit("offsets", offsets(out.label("offsets")))
        for name, blob in base_part:
            out.emit(name, blob)
        out.emit("seqs", seqs)
    out.data += random.Random(2).randbytes(500)
    return Built(bytes(out.data), out.labels)


LAYOUTS = [
    ("old", "percpu", 3),  # 5.10 .. 6.1
    ("old", "relative", 3),  # the same without absolute per-CPU symbols (other architectures)
    ("seqs", "percpu", 3),  # 6.2 .. 6.3 (and Debian's 6.1): seqs between markers and tokens
    ("seqs", "percpu", 4),  # the first seqs, one u32 each
    ("new", "percpu", 3),  # 6.4 on, x86_64 with a zero-based per-CPU area (6.12 included)
    ("new", "relative", 3),  # the same without absolute per-CPU symbols
    ("new", "pcrel", 3),  # 7.0 on: offsets relative to themselves, no base
]


@pytest.mark.parametrize(("order", "mode", "seq_width"), LAYOUTS)
def test_hand_built_tables_decode_in_every_layout(order: str, mode: str, seq_width: int) -> None:
    symbols = some_symbols(percpu=mode == "percpu")
    built = build(symbols, order, mode, seq_width)
    layout = locate_kallsyms(built.data, BASE)
    assert layout.count == len(symbols)
    assert layout.names == built.labels["names"]
    assert layout.markers == built.labels["markers"]
    assert layout.token_table == built.labels["token_table"]
    assert layout.offsets == built.labels["offsets"]
    assert layout.relative_base == built.labels.get("relative_base")
    assert layout.absolute_percpu == (mode == "percpu")
    decoded = decode_kallsyms(built.data, BASE)
    assert list(zip(decoded.addrs, decoded.types, decoded.names, strict=True)) == symbols


def test_before_6_1_a_length_of_0x80_or_more_is_one_byte() -> None:
    symbols = some_symbols(long_name=150)  # 0x80 .. 0xff codes
    built = build(symbols, "old", "percpu", wide=False)
    assert not locate_kallsyms(built.data, BASE).wide_lengths
    decoded = decode_kallsyms(built.data, BASE)
    assert list(zip(decoded.addrs, decoded.types, decoded.names, strict=True)) == symbols
    assert locate_kallsyms(build(symbols, "old", "percpu").data, BASE).wide_lengths


def test_tables_without_tokens_or_with_unsorted_offsets_are_refused() -> None:
    with pytest.raises(KernelImageError, match=r"no kallsyms tables in \.rodata \(no token table"):
        decode_kallsyms(random.Random(3).randbytes(100_000), BASE, "vmlinux")
    built = build(some_symbols(), "new", "percpu")
    at = built.labels["offsets"] + 4 * 500
    broken = built.data[:at] + struct.pack("<i", -5) + built.data[at + 4 :]
    with pytest.raises(KernelImageError, match="no offsets found"):
        decode_kallsyms(broken, BASE, "vmlinux")


def test_text_symbols_are_sized_to_the_next_and_named_by_the_first_alias() -> None:
    symbols = decode_kallsyms(build(some_symbols(), "new", "percpu").data, BASE)
    table = symbols.symbol_table()
    assert table.lookup(TEXT) == ("_stext", 0)  # the kernel's choice among _stext, _text, ...
    first = symbols.text_symbols()[:3]
    assert [s.name for s in first] == ["_stext", "schedule", "start_kernel"]
    assert first[0].size == first[1].addr - first[0].addr
    assert table.lookup(symbols.address_of("schedule") + 5) == ("schedule", 5)
    assert table.lookup(0x1000) is None  # per-CPU and data symbols name no code
    assert all(s.size > 0 for s in symbols.text_symbols()[:-1])


# The real kernel, against an oracle of its own: the export table.


def exported(elf: ElfImage) -> dict[str, int]:
    """name -> address from __ksymtab and __ksymtab_gpl: struct kernel_symbol with
    CONFIG_HAVE_ARCH_PREL32_RELOCATIONS is three s32 (value, name, namespace), each relative
    to its own address."""
    strings = elf.section("__ksymtab_strings")
    strings_addr = elf.section_addr("__ksymtab_strings")
    assert strings is not None and strings_addr is not None
    out = {}
    for section in ("__ksymtab", "__ksymtab_gpl"):
        data, addr = elf.section(section), elf.section_addr(section)
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


@pytest.mark.linux
def test_every_exported_symbol_has_its_kallsyms_address(debian: Kernel) -> None:
    exports = exported(debian.elf)
    code = debian.elf.code_ranges()
    functions = {n: a for n, a in exports.items() if any(lo <= a < hi for lo, hi in code)}
    assert len(functions) > 8000
    by_name: dict[str, set[int]] = {}
    for addr, name in zip(debian.symbols.addrs, debian.symbols.names, strict=True):
        by_name.setdefault(name, set()).add(addr)
    right = [n for n, a in functions.items() if a in by_name.get(n, ())]
    assert len(right) >= 0.99 * len(functions)
    everything = [n for n, a in exports.items() if a in by_name.get(n, ())]
    assert len(everything) >= 0.99 * len(exports)  # variables, per-CPU ones included


@pytest.mark.linux
def test_debian_tables_are_whole_in_the_order_of_their_version(debian: Kernel) -> None:
    rodata = debian.elf.section(".rodata")
    base = debian.elf.section_addr(".rodata")
    assert rodata is not None and base is not None
    layout = locate_kallsyms(rodata, base)
    if debian.series == "6.12":  # 6.4 on: offsets and base after the token index
        assert layout.names < layout.markers < layout.token_table < layout.offsets
    else:  # before: offsets and base first (6.1: seqs of names between markers and tokens)
        assert layout.offsets < layout.names < layout.markers < layout.token_table
        markers_end = layout.markers + 4 * ((layout.count + 255) // 256)
        if debian.series == "6.1":
            assert layout.token_table - markers_end >= 3 * layout.count
        else:  # 5.10: the token table follows the markers (aligned)
            assert 0 <= layout.token_table - markers_end < 256
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
