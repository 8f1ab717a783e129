"""kallsyms tables built by hand in every layout the kernel has used (the order of 5.10-6.3 and
of 6.4 on, 8-aligned, with or without absolute per-CPU symbols; 7.x's 4-aligned tables with
offsets relative to themselves and per-CPU symbols at ordinary addresses) and in layouts no
kernel has used yet (any order of the tables, any alignment): the locator reads them all."""

from __future__ import annotations

import random
import struct
from collections import Counter
from dataclasses import dataclass

import pytest

from qmpprof.errors import KernelImageError
from qmpprof.linux.kallsyms import decode_kallsyms, locate_kallsyms

BASE = 0xFFFFFFFF82000000  # where the hand-built .rodata is loaded
TEXT = 0xFFFFFFFF81000000
PERCPU = 0xFFFFFFFF83E0C000  # 7.x: the per-CPU section is ordinary kernel data

# A small scripts/kallsyms, written from the format: tokens, names, markers, offsets.


def some_symbols(
    count: int = 700, percpu: str = "zero-based", long_name: int = 300
) -> list[tuple[int, str, str]]:
    """(address, type, name), sorted: text, then data; per-CPU symbols ``zero-based`` (absolute,
    at 0 up, first), ``ordinary`` (data at PERCPU, last) or ``none``; one name of ``long_name``
    random characters, too long to compress below 0x80 codes."""
    rng = random.Random(7)
    out: list[tuple[int, str, str]] = []
    if percpu == "zero-based":
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
    if percpu == "ordinary":
        out += [(PERCPU, "D", "__per_cpu_start"), (PERCPU + 0x18018, "D", "current_task")]
        out += [(PERCPU + 0x18028, "d", "this_cpu_off"), (PERCPU + 0x36000, "D", "__per_cpu_end")]
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


# The tables in the order scripts/kallsyms has written them (a mode without a base drops it).
ORDERS = {
    "old": "offsets relative_base num_syms names markers token_table token_index",  # 5.10-6.1
    "seqs": "offsets relative_base num_syms names markers seqs token_table token_index",  # -6.3
    "new": "num_syms names markers token_table token_index offsets relative_base seqs",  # 6.4-
}


@dataclass
class Built:
    data: bytes
    labels: dict[str, int]


def build(
    symbols: list[tuple[int, str, str]],
    order: str | list[str],
    mode: str,
    seq_width: int = 3,
    wide: bool = True,
    align: int = 8,
) -> Built:
    """A .rodata at BASE holding the tables in ``order`` (an ORDERS key or the table names),
    each label aligned to ``align`` as scripts/kallsyms' ALGN, between random bytes. ``mode``:
    ``percpu`` (base, absolute per-CPU symbols), ``relative`` (base + u32) or ``pcrel`` (no
    base, each offset relative to itself)."""
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
    index, at = [], 0
    for t in tokens:
        index.append(at)
        at += len(t) + 1
    count = len(symbols)
    by_name = sorted(range(count), key=lambda i: symbols[i][2])
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

    blobs = {
        "num_syms": struct.pack("<I", count),
        "names": bytes(names),
        "markers": struct.pack(f"<{len(markers)}I", *markers),
        "seqs": b"".join(
            i.to_bytes(3, "big") if seq_width == 3 else struct.pack("<I", i) for i in by_name
        ),
        "token_table": b"".join(t.encode("latin-1") + b"\0" for t in tokens),
        "token_index": struct.pack("<256H", *index),
        "relative_base": struct.pack("<Q", relative_base),
    }
    data = bytearray(random.Random(1).randbytes(1000) + b"\0" * 333)
    labels: dict[str, int] = {}
    for name in ORDERS[order].split() if isinstance(order, str) else order:
        if name == "relative_base" and mode == "pcrel":
            continue
        data += b"\0" * (-(BASE + len(data)) % align)
        labels[name] = len(data)
        data += offsets(len(data)) if name == "offsets" else blobs[name]
    data += random.Random(2).randbytes(500)
    return Built(bytes(data), labels)


def check(built: Built, symbols: list[tuple[int, str, str]], mode: str) -> None:
    """The tables are found where they were put, read as they were written, decoded whole."""
    layout = locate_kallsyms(built.data, BASE)
    assert layout.count == len(symbols)
    assert layout.num_syms == built.labels["num_syms"]
    assert layout.names == built.labels["names"]
    assert layout.markers == built.labels["markers"]
    assert layout.token_table == built.labels["token_table"]
    assert layout.token_index == built.labels["token_index"]
    assert layout.offsets == built.labels["offsets"]
    assert layout.relative_base == built.labels.get("relative_base")
    assert layout.absolute_percpu == (mode == "percpu")
    decoded = decode_kallsyms(built.data, BASE)
    assert list(zip(decoded.addrs, decoded.types, decoded.names, strict=True)) == symbols


LAYOUTS = [
    ("old", "percpu", 3, 8),  # 5.10 .. 6.1
    ("old", "relative", 3, 8),  # the same without absolute per-CPU symbols (other architectures)
    ("seqs", "percpu", 3, 8),  # 6.2 .. 6.3 (and Debian's 6.1): seqs between markers and tokens
    ("seqs", "percpu", 4, 8),  # the first seqs, one u32 each
    ("new", "percpu", 3, 8),  # 6.4 on, x86_64 with a zero-based per-CPU area (6.12 included)
    ("new", "relative", 3, 8),  # the same without absolute per-CPU symbols
    ("new", "pcrel", 3, 8),  # offsets relative to themselves, 8-aligned
    ("new", "pcrel", 3, 4),  # 7.x (Debian's 7.2): the same 4-aligned, names 4 after the count
]


@pytest.mark.parametrize(("order", "mode", "seq_width", "align"), LAYOUTS)
def test_hand_built_tables_decode_in_every_layout(
    order: str, mode: str, seq_width: int, align: int
) -> None:
    percpu = {"percpu": "zero-based", "relative": "none", "pcrel": "ordinary"}[mode]
    symbols = some_symbols(percpu=percpu)
    check(build(symbols, order, mode, seq_width, align=align), symbols, mode)


@pytest.mark.parametrize("align", [1, 2, 4])
@pytest.mark.parametrize("order", ["old", "seqs", "new"])
def test_every_layout_decodes_with_labels_aligned_to_less_than_8(order: str, align: int) -> None:
    for mode, percpu in (("percpu", "zero-based"), ("relative", "none"), ("pcrel", "ordinary")):
        symbols = some_symbols(percpu=percpu)
        check(build(symbols, order, mode, align=align), symbols, mode)


@pytest.mark.parametrize("seed", range(12))
def test_tables_in_any_order_decode(seed: int) -> None:
    """Any order of the tables (the count right before the names, the base beside the
    offsets), any alignment and reading."""
    rng = random.Random(seed)
    mode, percpu = rng.choice(
        [("percpu", "zero-based"), ("relative", "none"), ("pcrel", "ordinary")]
    )
    units = [["num_syms", "names"], ["markers"], ["seqs"], ["token_table"], ["token_index"]]
    units.append(rng.choice([["offsets", "relative_base"], ["relative_base", "offsets"]]))
    rng.shuffle(units)
    order = [name for unit in units for name in unit]
    symbols = some_symbols(percpu=percpu)
    check(build(symbols, order, mode, align=rng.choice([1, 2, 4, 8])), symbols, mode)


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
    for mode, percpu in (("percpu", "zero-based"), ("pcrel", "ordinary")):
        built = build(some_symbols(percpu=percpu), "new", mode, align=4)
        at = built.labels["offsets"] + 4 * 500
        broken = built.data[:at] + struct.pack("<i", -5) + built.data[at + 4 :]
        with pytest.raises(KernelImageError, match="no offsets found"):
            decode_kallsyms(broken, BASE, "vmlinux")


def test_a_names_entry_off_its_marker_is_no_table() -> None:
    built = build(some_symbols(), "new", "percpu")
    at = built.labels["names"]
    broken = built.data[:at] + bytes([built.data[at] + 1]) + built.data[at + 1 :]
    with pytest.raises(KernelImageError, match="no names and markers found"):
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
