"""DwarfTypes on the hobby kernel's DWARF (its globals and types as fixtures/hobby/kernel.h lays
them out: i386, gcc -ggdb), and on a small program built with each DWARF version gcc writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from guestvm import BUILD_ROOT, build_fixtures

from qmpprof.elf.dwarftypes import DwarfTypes
from qmpprof.elf.image import ElfImage


def hobby_types() -> tuple[ElfImage, DwarfTypes]:
    build_fixtures(("hobby",))
    image = ElfImage.load(BUILD_ROOT / "hobby" / "kernel.elf")
    return image, DwarfTypes(image)


def data_symbol(image: ElfImage, name: str) -> int:
    """The address .symtab gives a data symbol (qmpprof's symbol table keeps code only)."""
    with open(image.path, "rb") as f:
        table = ELFFile(f).get_section_by_name(".symtab")
        assert isinstance(table, SymbolTableSection)
        (symbol,) = table.get_symbol_by_name(name) or []
        return int(symbol["st_value"])


def test_the_hobby_kernels_globals_and_types_as_its_source_says() -> None:
    image, types = hobby_types()
    cpus = types.variable("cpus")
    assert cpus is not None and cpus.addr == data_symbol(image, "cpus")
    array = types.type(cpus.type)
    assert (array.kind, array.count) == ("array", 2)  # struct cpu cpus[NCPU], NCPU 2
    assert array.target is not None
    cpu = types.type(array.target)
    proc_member = cpu.member("proc")
    assert cpu.name == "struct cpu" and proc_member is not None
    pointer = types.type(proc_member.type)
    assert pointer.kind == "pointer" and pointer.size == 4 and pointer.target is not None
    proc = types.type(pointer.target)
    # int pid; char name[16]; enum procstate state; uint *pgdir; ... (kernel.h)
    assert [(m.name, m.offset) for m in proc.members[:4]] == [
        ("pid", 0), ("name", 4), ("state", 20), ("pgdir", 24),
    ]  # fmt: skip
    pid, name, state = (types.type(m.type) for m in proc.members[:3])
    assert (pid.kind, pid.size, pid.signed) == ("int", 4, True)
    assert (name.kind, name.count, name.size) == ("array", 16, 16)
    assert name.target is not None and types.type(name.target).char
    assert (state.kind, state.name) == ("int", "enum procstate")
    # By name: struct proc as the first unit using it has it (each unit has its own copy).
    named = types.named("struct proc")
    assert named is not None
    layout = [(m.name, m.offset) for m in types.type(named).members]
    assert layout == [(m.name, m.offset) for m in proc.members]
    uint = types.named("uint")  # a typedef: its name kept, its type the base type's
    assert uint is not None and (types.type(uint).name, types.type(uint).signed) == ("uint", False)
    assert types.variable("no_such_global") is None and types.named("struct nothing") is None


def test_a_global_declared_extern_is_found_by_its_definition() -> None:
    image, types = hobby_types()
    # kernel.h declares "extern volatile uint ticks"; trap.c defines it: the definition's DIE
    # points back to the declaration's (DW_AT_specification) where gcc writes one.
    ticks = types.variable("ticks")
    assert ticks is not None and ticks.addr == data_symbol(image, "ticks")
    assert (types.type(ticks.type).kind, types.type(ticks.type).size) == ("int", 4)


SOURCE = """
struct task { int pid; char name[8]; struct task *next; unsigned flags : 3; };
struct cpu { int id; struct task *cur; };
struct cpu cpus[2];
struct task tasks[4];
void _start(void) { for (;;) cpus[0].cur = &tasks[cpus[1].id]; }
"""


@pytest.mark.parametrize("version", [2, 3, 4, 5])
def test_every_dwarf_version_gcc_writes_gives_the_same_types(tmp_path: Path, version: int) -> None:
    """DWARF 2 gives a member's offset as an expression (DW_OP_plus_uconst), later versions as
    a constant; a bit field is told as one whichever way its bits are placed."""
    source, program = tmp_path / "k.c", tmp_path / "k"
    source.write_text(SOURCE)
    flags = ["-m32", "-O1", f"-gdwarf-{version}", "-ffreestanding", "-nostdlib", "-static"]
    subprocess.run(["gcc", *flags, "-fno-pie", "-no-pie", "-o", str(program), str(source)],
                   check=True)  # fmt: skip
    image = ElfImage.load(program)
    types = DwarfTypes(image)
    cpus = types.variable("cpus")
    assert cpus is not None and cpus.addr == data_symbol(image, "cpus")
    array = types.type(cpus.type)
    assert array.target is not None and array.count == 2
    cur = types.type(array.target).member("cur")
    assert cur is not None
    pointer = types.type(cur.type)
    assert pointer.target is not None
    task = types.type(pointer.target)
    assert [(m.name, m.offset) for m in task.members if not m.bits] == [
        ("pid", 0), ("name", 4), ("next", 12),
    ]  # fmt: skip
    assert [m.name for m in task.members if m.bits] == ["flags"]
