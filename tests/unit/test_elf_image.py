"""ElfImage on real gcc output (checked against binutils) and on every kind of bad file."""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
from pathlib import Path

import linuxkernel
import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.enums import ENUM_SH_TYPE_BASE

from qmpprof.arch.x86 import I386
from qmpprof.elf.image import ElfImage
from qmpprof.errors import ElfError
from qmpprof.unwind.space import Module

DATA = Path(__file__).parents[1] / "data" / "unwind"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("elf") / "work"
    subprocess.run(["gcc", "-O2", "-o", str(out), str(DATA / "work.c")], check=True)
    return out


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("kernel.elf", "kernel"),
        ("qmpprof_burn.ko", "qmpprof_burn"),
        ("xz", "xz"),
        ("libc.so.6", "libc.so.6"),
        ("liblzma.so.5.4.1", "liblzma.so.5.4.1"),
        ("libfoo.so", "libfoo.so"),
        ("python3.11", "python3.11"),
    ],
)
def test_name_keeps_a_shared_objects_version(
    work: Path, tmp_path: Path, file: str, name: str
) -> None:
    """Frames are named by it: a library's name is its file name (the stem of
    liblzma.so.5.4.1 names a version that does not exist)."""
    copy = tmp_path / file
    copy.write_bytes(work.read_bytes())
    assert ElfImage.load(copy).name == name


def binutils(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def test_identity_and_layout_match_binutils(work: Path, tmp_path: Path) -> None:
    image = ElfImage.load(work)
    assert (image.path, image.name) == (str(work), "work")
    build_id = re.search(r"Build ID: ([0-9a-f]+)", binutils("readelf", "-n", str(work)))
    assert build_id is not None and image.build_id == build_id[1]
    text = re.search(r"\.text\s+PROGBITS\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)",
                     binutils("readelf", "-SW", str(work)))  # fmt: skip
    assert text is not None
    assert (image.text_addr, image.text_size) == (int(text[1], 16), int(text[2], 16))
    raw = tmp_path / "text.bin"
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", str(work), str(raw)],
                   check=True)  # fmt: skip
    assert image.text_bytes == raw.read_bytes()
    assert image.text_sha256 == hashlib.sha256(raw.read_bytes()).hexdigest()
    loads = re.findall(r"LOAD\s+0x[0-9a-f]+ (0x[0-9a-f]+) 0x[0-9a-f]+ 0x[0-9a-f]+ (0x[0-9a-f]+)",
                       binutils("readelf", "-lW", str(work)))  # fmt: skip
    assert image.load_range == (
        min(int(v, 16) for v, _ in loads),
        max(int(v, 16) + int(s, 16) for v, s in loads),
    )


def test_symbols_match_nm(work: Path) -> None:
    image = ElfImage.load(work)
    for line in binutils("nm", "-S", "--defined-only", str(work)).splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[2] in "Tt" and fields[3].startswith("uw_"):
            addr, size = int(fields[0], 16), int(fields[1], 16)
            assert image.symbols.lookup(addr) == (fields[3], 0)
            assert image.symbols.lookup(addr + size - 1) == (fields[3], size - 1)
            assert image.symbols.address_of(fields[3]) == addr


def test_sections_and_cfi(work: Path) -> None:
    image = ElfImage.load(work)
    eh = image.section(".eh_frame")
    assert eh is not None and len(eh) > 64
    assert image.section_addr(".eh_frame") is not None
    assert image.section(".bss") is None  # NOBITS: no bytes in the file
    assert image.section(".no-such-section") is None
    assert image.section_addr(".no-such-section") is None
    assert image.cfi is not None
    main = image.symbols.address_of("main")
    assert main is not None and image.cfi.row_for(main) is not None


def test_stripped_binary_keeps_dynamic_symbols_only(work: Path, tmp_path: Path) -> None:
    stripped = tmp_path / "stripped"
    subprocess.run(["strip", "-o", str(stripped), str(work)], check=True)
    image = ElfImage.load(stripped)
    assert image.symbols.address_of("main") is None
    assert image.text_sha256 == ElfImage.load(work).text_sha256  # same code, same identity


def test_assembly_labels_without_a_type_are_symbols(tmp_path: Path) -> None:
    source = tmp_path / "entry.s"
    source.write_text(".text\n.globl isr_stub\nisr_stub:\n nop\n iretq\n.globl data_label\n"
                      ".data\ndata_label: .quad 0\n")  # fmt: skip
    lib = tmp_path / "entry.so"
    subprocess.run(["gcc", "-shared", "-nostdlib", "-o", str(lib), str(source)], check=True)
    image = ElfImage.load(lib)
    stub = image.symbols.address_of("isr_stub")
    assert stub is not None and image.symbols.lookup(stub + 1) == ("isr_stub", 1)
    assert image.symbols.address_of("data_label") is None  # not code


def pyelftools_headers(
    data: bytes,
) -> tuple[list[tuple[object, ...]], list[tuple[int, ...]], int | None]:
    """Sections (name, type number, flags, addr, offset, size, link), PT_LOAD segments (vaddr,
    offset, memsz) and the entry point, as pyelftools reads them."""
    elf = ELFFile(io.BytesIO(data))
    sections = [
        (s.name, ENUM_SH_TYPE_BASE.get(s["sh_type"], s["sh_type"]), s["sh_flags"], s["sh_addr"],
         s["sh_offset"], s["sh_size"], s["sh_link"])
        for s in elf.iter_sections()
    ]  # fmt: skip
    loads = [
        (p["p_vaddr"], p["p_offset"], p["p_memsz"])
        for p in elf.iter_segments()
        if p["p_type"] == "PT_LOAD"
    ]
    # An executable's e_entry is its entry point even at 0; another file's 0 names none.
    entry = elf.header["e_entry"]
    return sections, loads, entry if entry or elf.header["e_type"] == "ET_EXEC" else None


def own_headers(
    image: ElfImage,
) -> tuple[list[tuple[object, ...]], list[tuple[int, ...]], int | None]:
    sections = [
        (h.name, h.type, h.flags, h.addr, h.offset, h.size, h.link) for h in image._section_list
    ]
    low, high = image.load_range
    return sections, [(low, image.load_offset, high - low)], image.entry


@pytest.mark.parametrize("source", ["work", "i386_object", "vmlinux"])
def test_headers_match_pyelftools(request: pytest.FixtureRequest, source: str) -> None:
    """The headers ElfImage reads itself are the ones pyelftools reads (the load range is
    compared as the union of PT_LOAD segments), mapped or read."""
    if source == "vmlinux":
        image = linuxkernel.vmlinux()
        data = image.file_bytes(0, 1 << 40)
    else:
        path = request.getfixturevalue(source)
        data = path.read_bytes()
        image = ElfImage.load(path, mapped=True)
        assert own_headers(image) == own_headers(ElfImage.load(path))
    sections, loads, entry = pyelftools_headers(data)
    ours = own_headers(image)
    assert ours[0] == sections and ours[2] == entry
    if loads:
        low = min(v for v, _, _ in loads)
        offset = min(loads)[1]
        high = max(v + m for v, _, m in loads)
        assert ours[1] == [(low, offset, high - low)]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ElfError, match="No such file") as err:
        ElfImage.load(tmp_path / "nope")
    assert err.value.path == str(tmp_path / "nope")


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage"
    path.write_bytes(b"#!/bin/sh\necho not an elf\n")
    with pytest.raises(ElfError, match="no ELF magic"):
        ElfImage.load(path)


@pytest.mark.parametrize("keep", [16, 64, 300, 0.5])
def test_truncated_elf(work: Path, tmp_path: Path, keep: float) -> None:
    data = work.read_bytes()
    size = int(len(data) * keep) if isinstance(keep, float) else keep
    path = tmp_path / "truncated"
    path.write_bytes(data[:size])
    with pytest.raises(ElfError) as err:
        ElfImage.load(path)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def i386_object(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("i386")
    source, obj = folder / "t.s", folder / "t.o"
    source.write_text("nop\n")
    subprocess.run(["as", "--32", "-o", str(obj), str(source)], check=True)
    return obj


def test_a_program_linked_at_0_has_its_entry_function_as_outermost(tmp_path: Path) -> None:
    """A program's entry (e_entry 0 here, as teaching kernels link them) is a function nothing
    calls: its module's walk ends there. A shared object whose e_entry is 0 names none."""
    source, program, lib = tmp_path / "start.s", tmp_path / "prog", tmp_path / "lib.so"
    source.write_text(".text\n.globl _start\n_start:\n xor %ebp, %ebp\n call main\n"
                      "1: jmp 1b\n.globl main\nmain:\n ret\n")  # fmt: skip
    subprocess.run(["gcc", "-m32", "-nostdlib", "-static", "-Wl,-Ttext=0", "-Wl,-e,_start",
                    "-o", str(program), str(source)], check=True)  # fmt: skip
    image = ElfImage.load(program)
    start, main = image.symbols.address_of("_start"), image.symbols.address_of("main")
    assert image.entry == start == 0
    assert Module.from_image(image, kernel=False, bias=0x1000).outermost == (0x1000, main + 0x1000)
    subprocess.run(["gcc", "-m32", "-shared", "-nostdlib", "-Wl,-e,0", "-o", str(lib),
                    str(source)], check=True)  # fmt: skip
    shared = ElfImage.load(lib)
    assert shared.entry is None
    assert Module.from_image(shared, kernel=False).outermost is None


def test_32_bit_i386_elf_loads(i386_object: Path) -> None:
    assert ElfImage.load(i386_object).arch is I386


@pytest.mark.parametrize(
    ("original", "machine", "described"),
    [("work", 21, "64-bit EM_PPC64"), ("i386_object", 40, "32-bit EM_ARM")],
)
def test_other_machine_is_rejected(
    request: pytest.FixtureRequest, tmp_path: Path, original: str, machine: int, described: str
) -> None:
    data = bytearray(request.getfixturevalue(original).read_bytes())
    data[18:20] = machine.to_bytes(2, "little")  # e_machine
    path = tmp_path / "other"
    path.write_bytes(bytes(data))
    known = "x86_64, i386, aarch64, riscv64"
    with pytest.raises(ElfError, match=f"{described}: qmpprof reads {known}"):
        ElfImage.load(path)
