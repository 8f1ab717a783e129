"""--lines: file:line and inlined frames for every instruction, checked against addr2line -i."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

from qmpprof.arch.x86 import X86_64
from qmpprof.dwarf.dies import UnitWalk
from qmpprof.dwarf.encoding import CfiDecodeError
from qmpprof.elf import lines
from qmpprof.elf.image import ElfImage
from qmpprof.elf.lines import LineTable
from qmpprof.model import StopReason
from qmpprof.unwind.chain import AddressSpace, Module, RawStack, Unwinder

DATA = Path(__file__).parents[1] / "data" / "unwind"


@pytest.fixture(scope="module")
def inline_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lines") / "inline"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(out), str(DATA / "inline.c")], check=True)
    return out


def instructions(binary: Path, function: str) -> list[int]:
    text = subprocess.run(
        ["objdump", "-d", f"--disassemble={function}", str(binary)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [int(m[1], 16) for m in re.finditer(r"^\s+([0-9a-f]+):", text, re.MULTILINE)]


def addr2line(
    binary: Path, addrs: list[int]
) -> dict[int, list[tuple[str, str | None, int | None]]]:
    """addr2line -i's (function, file basename, line) chain per address, innermost first."""
    text = subprocess.run(
        ["addr2line", "-a", "-i", "-f", "-e", str(binary), *(hex(a) for a in addrs)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    out: dict[int, list[tuple[str, str | None, int | None]]] = {}
    current: list[tuple[str, str | None, int | None]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            current = out.setdefault(int(lines[i], 16), [])
            i += 1
            continue
        function, position = lines[i], lines[i + 1].split(" (discriminator")[0]
        path, _, line = position.rpartition(":")
        current.append(
            (
                function,
                None if path == "??" else Path(path).name,
                int(line) if line.isdigit() else None,
            )
        )
        i += 2
    return out


@pytest.fixture(scope="module", params=["-gdwarf-2", "-gdwarf-4", "-gdwarf-5"])
def versioned_binary(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """inline.c with DWARF 2 (high_pc an address), 4 (a length, DW_AT_ranges in .debug_ranges),
    5 (.debug_rnglists, line_strp)."""
    out = tmp_path_factory.mktemp("lines") / "inline"
    flags = ["-O2", "-g", request.param]
    subprocess.run(["gcc", *flags, "-o", str(out), str(DATA / "inline.c")], check=True)
    return out


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_every_instruction_matches_addr2line(inline_binary: Path, mapped: bool) -> None:
    assert_matches_addr2line(inline_binary, ElfImage.load(inline_binary, mapped=mapped))


def fail(*args: object) -> NoReturn:
    raise CfiDecodeError("bytes the walk cannot read")


@pytest.mark.parametrize("reader", ["walk", "no walk", "walk fails"])
def test_every_dwarf_version_matches_addr2line_walked_or_not(
    versioned_binary: Path, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk over the unit's bytes answers (pyelftools' DIE tree is never read); where it
    cannot read a unit's abbreviations or DIEs, pyelftools' DIEs give the same answers."""
    if reader == "walk":
        monkeypatch.setattr(lines, "_dies_inline_chain", fail)
    elif reader == "no walk":
        monkeypatch.setattr(lines, "abbrevs_at", fail)
    else:
        monkeypatch.setattr(UnitWalk, "scopes_at", fail)
    assert_matches_addr2line(versioned_binary, ElfImage.load(versioned_binary))


def test_a_skeleton_unit_gives_the_line_without_inlined_frames(
    inline_binary: Path, tmp_path: Path
) -> None:
    """Split DWARF: the DIEs are in a .dwo file, which neither reader opens; the line table is
    in the binary. Each pc gets its innermost position, as addr2line has it on the same code
    built without -gsplit-dwarf."""
    split = tmp_path / "split"
    source = DATA / "inline.c"
    flags = ["-O2", "-g", "-gsplit-dwarf"]
    subprocess.run(["gcc", *flags, "-o", str(split), str(source)], check=True, cwd=tmp_path)
    image = ElfImage.load(split)
    assert image.lines is not None
    split_addrs, plain_addrs = instructions(split, "outer"), instructions(inline_binary, "outer")
    assert [a - split_addrs[0] for a in split_addrs] == [a - plain_addrs[0] for a in plain_addrs]
    expected = addr2line(inline_binary, plain_addrs)
    for addr, plain in zip(split_addrs, plain_addrs, strict=True):
        got = [(f.function, f.file, f.line) for f in image.lines.frames(addr)]
        assert got == [(None, *expected[plain][0][1:])], hex(addr)
    assert max(len(expected[plain]) for plain in plain_addrs) == 3  # inlined calls not shown


def assert_matches_addr2line(binary: Path, image: ElfImage) -> None:
    assert isinstance(image.lines, LineTable)
    addrs = instructions(binary, "outer") + instructions(binary, "main")
    expected = addr2line(binary, addrs)
    inlined_seen = 0
    for addr in addrs:
        frames = image.lines.frames(addr)
        got = [(f.function, f.file, f.line) for f in frames]
        want = expected[addr]
        # The outermost frame's name comes from the symbol table, not from DWARF.
        assert [g[1:] for g in got] == [w[1:] for w in want], hex(addr)
        assert [g[0] for g in got[:-1]] == [w[0] for w in want[:-1]], hex(addr)
        assert got[-1][0] is None
        inlined_seen += len(got) > 1
    assert inlined_seen >= 5  # the test binary really has inlined code


def test_symbolize_with_lines_expands_inlined_frames(inline_binary: Path) -> None:
    image = ElfImage.load(inline_binary)
    assert image.lines is not None
    outer = image.symbols.address_of("outer")
    assert outer is not None
    pc = next(a for a in instructions(inline_binary, "outer") if len(image.lines.frames(a)) == 3)
    space = AddressSpace([Module.from_image(image, kernel=False)])
    raw = RawStack((pc,), StopReason.END, (True,))
    plain = Unwinder(X86_64).resolve(raw, space)
    assert [f.symbol for f in plain.frames] == ["outer"] and plain.frames[0].line is None
    detailed = Unwinder(X86_64, lines=True).resolve(raw, space)
    assert Unwinder(X86_64, lines=True).resolve(raw, space, lines=False) == plain
    assert [(f.symbol, f.inlined) for f in detailed.frames] == [
        ("mix", True),
        ("round2", True),
        ("outer", False),
    ]
    assert all(f.file == "inline.c" and f.line for f in detailed.frames)
    assert detailed.frames[-1].offset == pc - outer


def test_no_dwarf_means_no_lines(tmp_path: Path) -> None:
    binary = tmp_path / "nodebug"
    subprocess.run(["gcc", "-O2", "-o", str(binary), str(DATA / "inline.c")], check=True)
    assert ElfImage.load(binary).lines is None


def test_broken_dwarf_gives_empty_answers() -> None:
    def broken() -> object:
        raise ValueError("pyelftools could not decode the DWARF")

    assert LineTable(broken).frames(0x1000) == ()
