"""A module's build-id and sections as sysfs shows them, read from a fake guest memory in both
layouts BTF gives (6.12: counted, the address beside each bin_attribute; 7.2: a NULL-ended
pointer list, the address in ``private``), and a relocatable file's DWARF placed where its
sections were loaded, against binutils' ``addr2line -j`` on the same file."""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from qmpprof.elf.image import ElfImage
from qmpprof.linux.running.moduledebug import AttrList, DebugLayout, build_id, placed, read_attrs

ID = "9de1ef82627ed5cd3ef884b6a7d6935f0654cc49"
NOTE = struct.pack("<III", 4, 20, 3) + b"GNU\0" + bytes.fromhex(ID)
INLINE_C = Path(__file__).parents[1] / "data" / "unwind" / "inline.c"
MODULE = 0x1000  # struct module
# bin_attribute: attr.name at 0, size at 16, private at 24 (as 6.12's and 7.2's BTF have it).
NAME, SIZE, PRIVATE = 0, 16, 24


class Memory:
    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}

    def put(self, at: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.bytes[at + i] = b

    def q(self, at: int, value: int) -> None:
        self.put(at, value.to_bytes(8, "little"))

    async def read(self, pieces: Sequence[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for at, size in pieces:
            got = [self.bytes.get(a) for a in range(at, at + size)]
            out.append(None if None in got else bytes(b or 0 for b in got))
        return out


def attribute(mem: Memory, at: int, name: str, size: int, private: int) -> None:
    name_at = 0x10000 + 4 * at  # apart for every element
    mem.put(name_at, name.encode() + b"\0" + bytes(200))
    mem.q(at + NAME, name_at)
    mem.q(at + SIZE, size)
    mem.q(at + PRIVATE, private)


SECTIONS = {".text": 0xFFFFFFFFC0001000, ".exit.text": 0xFFFFFFFFC0003000}


def counted(mem: Memory) -> DebugLayout:
    """6.12's: module_sect_attr {battr; address} elements, nsections and notes counts."""
    sections = AttrList(pointer=8, count=4, pointers=0, first=8, stride=72, battr=0, address=64)
    notes = AttrList(pointer=16, count=8, pointers=0, first=16, stride=64, battr=0, address=None)
    mem.q(MODULE + 8, 0x2000)
    mem.put(0x2000 + 4, len(SECTIONS).to_bytes(4, "little"))
    for i, (name, address) in enumerate(SECTIONS.items()):
        element = 0x2000 + 8 + 72 * i
        attribute(mem, element, name, 8, 0)
        mem.q(element + 64, address)
    mem.q(MODULE + 16, 0x3000)
    mem.put(0x3000 + 8, (2).to_bytes(4, "little"))
    attribute(mem, 0x3000 + 16, ".note.Linux", 24, 0x5000)
    attribute(mem, 0x3000 + 16 + 64, ".note.gnu.build-id", len(NOTE), 0x5100)
    mem.put(0x5100, NOTE)
    return DebugLayout(sections, notes, NAME, SIZE, PRIVATE)


def listed(mem: Memory) -> DebugLayout:
    """7.2's: bin_attribute elements, grp.bin_attrs NULL-terminated, the address in private."""
    sections = AttrList(pointer=8, count=None, pointers=40, first=48, stride=64, battr=0,
                        address=None)  # fmt: skip
    notes = AttrList(pointer=16, count=None, pointers=40, first=48, stride=64, battr=0,
                     address=None)  # fmt: skip
    for base, array, attrs in (
        (0x2000, 0x2800, [(n, 8, a) for n, a in SECTIONS.items()]),
        (0x3000, 0x3800, [(".note.gnu.build-id", len(NOTE), 0x5100)]),
    ):
        mem.q(MODULE + (8 if base == 0x2000 else 16), base)
        mem.q(base + 40, array)
        for i, (name, size, private) in enumerate(attrs):
            attribute(mem, base + 48 + 64 * i, name, size, private)
            mem.q(array + 8 * i, base + 48 + 64 * i)
        mem.put(array + 8 * len(attrs), bytes(0x1000 - 8 * len(attrs)))
    mem.put(0x5100, NOTE)
    return DebugLayout(sections, notes, NAME, SIZE, PRIVATE)


@pytest.mark.parametrize("shape", [counted, listed])
async def test_sections_and_build_id_as_sysfs_shows_them(shape: object) -> None:
    mem = Memory()
    layout = shape(mem)  # type: ignore[operator]
    found = await read_attrs(mem.read, MODULE, layout, notes=False)
    assert {a.name: a.value for a in found} == SECTIONS
    assert await build_id(mem.read, MODULE, layout) == ID


async def test_no_lists_no_build_id() -> None:
    mem = Memory()
    layout = counted(Memory())
    mem.q(MODULE + 8, 0)
    mem.q(MODULE + 16, 0)
    assert await read_attrs(mem.read, MODULE, layout, notes=False) == []
    assert await build_id(mem.read, MODULE, layout) is None


def test_a_relocatable_files_lines_placed_where_its_text_was_loaded(tmp_path: Path) -> None:
    obj = tmp_path / "inline.o"
    subprocess.run(["gcc", "-O2", "-g", "-c", "-o", str(obj), str(INLINE_C)], check=True)
    image = ElfImage.load(obj)
    text = image.section_header(".text")
    assert text is not None and text.size > 16
    lines = placed(image, SECTIONS).lines
    assert lines is not None
    offsets = list(range(text.size))
    out = subprocess.run(
        ["addr2line", "-i", "-j", ".text", "-e", str(obj), *map(hex, offsets)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    # One line per frame; an offset's first line is its innermost frame's.
    ours = [lines.frames(SECTIONS[".text"] + o) for o in offsets]
    flat = [f"{Path(f.file or '??').name}:{f.line or '?'}" for frames in ours for f in frames]
    theirs = [Path(x.split(" (discriminator")[0]).name for x in out.splitlines()]
    assert flat == theirs
    assert placed(image, {}).lines is not None  # unplaced: at 0, no error
