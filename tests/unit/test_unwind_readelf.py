"""CfiTable against the strongest oracle at hand: for every FDE of real gcc/g++ output, every
row readelf --debug-dump=frames-interp prints must equal the row CfiTable.row_for compiles."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from guestvm import build_fixtures

from qmpprof.arch.x86 import I386, X86_64
from qmpprof.dwarf.cfi import CfiTable, Kind, RegRule, Rule
from qmpprof.elf.image import ElfImage

DATA = Path(__file__).parents[1] / "data" / "unwind"

_SECTION = re.compile(r"^Contents of the (\.\w+) section")
_CIE = re.compile(r"^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ CIE ")
_FDE = re.compile(
    r"^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ FDE cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+)"
)
# A row's LOC is a full 64- or 32-bit address ("00000068 ZERO terminator" is no row).
_ROW = re.compile(r"^([0-9a-f]{16}|[0-9a-f]{8}) (?!ZERO)(.*)$")
_VALUE = re.compile(r"r\d+ \([^)]*\)|\S+")  # "r9 (r9)" is the only value with a space inside
REG_NAMES = (*X86_64.names[:16], "rip", *(f"xmm{i}" for i in range(16)))
I386_NAMES = I386.names  # readelf's i386 columns: eax ecx edx ebx esp ebp esi edi eip


@dataclass
class Entry:
    """A CIE or FDE as readelf interprets it: rows of (loc, {"CFA": ..., column: rule})."""

    offset: int
    cie: int | None = None
    pc_begin: int = 0
    pc_end: int = 0
    rows: list[tuple[int, dict[str, str]]] = field(default_factory=list)


def readelf_frames(path: Path) -> dict[str, dict[int, Entry]]:
    """Entries by section (.eh_frame, .debug_frame) and offset."""
    text = subprocess.run(
        ["readelf", "--debug-dump=frames-interp", str(path)], capture_output=True, text=True
    ).stdout
    sections: dict[str, dict[int, Entry]] = {}
    entries: dict[int, Entry] = {}
    current: Entry | None = None
    columns: list[str] = []
    for line in text.splitlines():
        if m := _SECTION.match(line):
            entries = sections.setdefault(m[1], {})
        elif m := _FDE.match(line):
            current = Entry(int(m[1], 16), int(m[2], 16), int(m[3], 16), int(m[4], 16))
            entries[current.offset] = current
        elif m := _CIE.match(line):
            current = Entry(int(m[1], 16))
            entries[current.offset] = current
        elif line.startswith("   LOC"):
            columns = line.split()[1:]
        elif current is not None and (m := _ROW.match(line)):
            values = _VALUE.findall(m[2])
            current.rows.append((int(m[1], 16), dict(zip(columns, values, strict=True))))
    return sections


def _reg_text(rule: RegRule, names: tuple[str, ...]) -> str:
    simple = {Kind.UNDEFINED: "u", Kind.SAME: "s", Kind.EXPRESSION: "exp"}
    if rule.kind in simple:
        return simple[rule.kind]
    if rule.kind is Kind.VAL_EXPRESSION:
        return "vexp"
    if rule.kind is Kind.OFFSET:
        return f"c{rule.value:+d}"
    if rule.kind is Kind.VAL_OFFSET:
        return f"v{rule.value:+d}"
    return f"r{rule.value} ({names[rule.value]})"


def render(rule: Rule, columns: list[str], names: tuple[str, ...] = REG_NAMES) -> dict[str, str]:
    """Our row in readelf's notation, for readelf's columns (``names``: DWARF number -> name)."""
    cfa = "exp" if rule.cfa_expr is not None else f"{names[rule.cfa_reg]}{rule.cfa_offset:+d}"
    regs = dict(rule.regs)
    out = {"CFA": cfa}
    for column in columns[1:]:
        number = rule.ra if column == "ra" else names.index(column)
        out[column] = _reg_text(regs[number], names) if number in regs else "u"
    # Every register we have a rule for must be a column readelf shows.
    named = {rule.ra if c == "ra" else names.index(c) for c in columns[1:]}
    assert set(regs) <= named, (hex(rule.start), regs)
    return out


def compare(table: CfiTable, entries: dict[int, Entry], names: tuple[str, ...] = REG_NAMES) -> int:
    """Assert every readelf row; return how many were compared."""
    fdes = [e for e in entries.values() if e.cie is not None]
    assert sorted((f.pc_begin, f.pc_end) for f in table.fdes()) == sorted(
        (e.pc_begin, e.pc_end) for e in fdes
    )
    compared = 0
    for entry in fdes:
        assert entry.cie is not None
        # An FDE without instructions prints no rows: it has the CIE's initial row.
        rows = entry.rows or [(entry.pc_begin, r) for _, r in entries[entry.cie].rows]
        for loc, want in rows:
            if not entry.pc_begin <= loc < entry.pc_end:
                continue  # readelf prints advances past the FDE's range too
            rule = table.row_for(loc)
            assert rule is not None, hex(loc)
            assert render(rule, list(want), names) == want, hex(loc)
            compared += 1
    return compared


def build(tmp: Path, name: str, source: str, *flags: str) -> Path:
    out = tmp / name
    compiler = "g++" if source.endswith(".cc") else "gcc"
    subprocess.run([compiler, *flags, "-o", str(out), str(DATA / source)], check=True)
    return out


VARIANTS = {
    "o2-omit-fp": ("work.c", "-O2", "-fomit-frame-pointer"),
    "o0-fp": ("work.c", "-O0", "-fno-omit-frame-pointer"),
    "cfi-ops": ("cfi_ops.s", "-shared", "-nostdlib"),
    "cxx-exceptions": ("throw.cc", "-O1", "-mno-accumulate-outgoing-args", "-mpush-args"),
    "static-libc": ("work.c", "-O2", "-static"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_eh_frame_rows_match_readelf(variant: str, tmp_path: Path) -> None:
    source, *flags = VARIANTS[variant]
    image = ElfImage.load(build(tmp_path, variant, source, *flags))
    assert image.cfi is not None
    compared = compare(image.cfi, readelf_frames(Path(image.path))[".eh_frame"])
    assert compared >= 10


def test_debug_frame_rows_match_readelf(tmp_path: Path) -> None:
    path = build(tmp_path, "dbg", "work.c", "-O2", "-g", "-fno-asynchronous-unwind-tables")
    image = ElfImage.load(path)
    data = image.section(".debug_frame")
    assert data is not None
    table = CfiTable.parse(data, 0, kind="debug_frame")
    assert compare(table, readelf_frames(path)[".debug_frame"]) >= 10


def test_eh_frame_without_hdr_scans_the_same_rows(tmp_path: Path) -> None:
    image = ElfImage.load(build(tmp_path, "fp", "work.c", "-O2"))
    data = image.section(".eh_frame")
    assert data is not None
    table = CfiTable.parse(data, image.section_addr(".eh_frame") or 0)  # no .eh_frame_hdr
    assert compare(table, readelf_frames(Path(image.path))[".eh_frame"]) >= 10


@pytest.mark.parametrize("variant", ["cfi", "fp"])
def test_bundled_guest_cfi_matches_readelf(variant: str, guest_build: None) -> None:
    build_dir = Path(__file__).parents[2] / "fixtures" / "build" / variant
    section = ".eh_frame" if variant == "cfi" else ".debug_frame"  # fp: no .eh_frame at all
    elfs = [build_dir / "kernel.elf", *sorted((build_dir / "user").glob("*.elf"))]
    assert len(elfs) >= 3
    for path in elfs:
        image = ElfImage.load(path)
        assert image.cfi is not None and image.cfi.kind == section[1:]
        assert compare(image.cfi, readelf_frames(path)[section]) >= 5, path
    kernel = ElfImage.load(build_dir / "kernel.elf")
    assert kernel.cfi is not None
    # The syscall entry stub describes the interrupted user frame as a signal frame.
    entry = kernel.symbols.address_of("entry_syscall")
    dispatch = kernel.symbols.address_of("syscall_dispatch")
    assert entry is not None and dispatch is not None
    call_rows = [
        rule
        for fde in kernel.cfi.fdes()
        if fde.pc_begin == entry
        for rule in kernel.cfi.rows(fde)
        if rule.reg(7) is not None
    ]
    assert call_rows and all(rule.signal for rule in call_rows)


def test_i386_guest_cfi_matches_readelf() -> None:
    """The i386 build (fixtures/build/i386): 4-byte addresses, i386 register numbers, the entry
    stubs' esp expressions, in the kernel and in both user programs."""
    build_fixtures(("i386",))
    build_dir = Path(__file__).parents[2] / "fixtures" / "build" / "i386"
    for path in [build_dir / "kernel.elf", *sorted((build_dir / "user").glob("*.elf"))]:
        image = ElfImage.load(path)
        assert image.cfi is not None and image.cfi.address_size == 4
        assert compare(image.cfi, readelf_frames(path)[".eh_frame"], I386_NAMES) >= 10, path


@pytest.mark.parametrize("variant", ["cfi", "fp"])
def test_a_row_looked_up_alone_is_the_row_the_whole_fde_compiles(
    variant: str, guest_build: None
) -> None:
    """``row_for`` builds the row at its pc alone (the program run no further); at every row's
    first and last address it equals the row of the FDE compiled whole, and past the FDE there
    is none."""
    path = Path(__file__).parents[2] / "fixtures" / "build" / variant / "kernel.elf"
    whole, alone = ElfImage.load(path).cfi, ElfImage.load(path).cfi
    assert whole is not None and alone is not None
    checked = 0
    for fde in whole.fdes():
        for rule in whole.rows(fde):
            assert alone.row_for(rule.start) == rule and alone.row_for(rule.end - 1) == rule
            checked += 1
    assert checked >= 50
