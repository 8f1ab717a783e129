"""BTF over a hand-built blob holding every kind (one record per field, as btf.h lays it out),
and over Debian's 6.12 vmlinux against pahole and bpftool reading the same file."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from qmpprof.elf.image import ElfImage
from qmpprof.linux.btf import Btf, BtfError, Kind


class Blob:
    """A .BTF section built one type record at a time; ids count from 1."""

    def __init__(self) -> None:
        self.strings = bytearray(b"\0")
        self.types = bytearray()
        self.count = 0

    def name(self, text: str) -> int:
        if not text:
            return 0
        offset = len(self.strings)
        self.strings += text.encode() + b"\0"
        return offset

    def add(self, kind: Kind, name: str, ref: int, vlen: int = 0, flag: bool = False) -> int:
        info = vlen | int(kind) << 24 | int(flag) << 31
        self.types += struct.pack("<III", self.name(name), info, ref)
        self.count += 1
        return self.count

    def extra(self, fmt: str, *values: int) -> None:
        self.types += struct.pack(fmt, *values)

    def member(self, name: str, type_id: int, offset: int) -> None:
        self.extra("<I", self.name(name))
        self.extra("<II", type_id, offset)

    def build(self) -> bytes:
        header = struct.pack(
            "<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(self.types), len(self.types), len(self.strings)
        )
        return header + bytes(self.types) + bytes(self.strings)


def sample() -> Btf:
    b = Blob()
    b.add(Kind.INT, "int", 4)  # 1
    b.extra("<I", 1 << 24 | 32)  # signed, bit offset 0, 32 bits
    b.add(Kind.INT, "char", 1)  # 2
    b.extra("<I", 2 << 24 | 8)  # char, 8 bits
    b.add(Kind.PTR, "", 5)  # 3: struct task *
    b.add(Kind.ARRAY, "", 0)  # 4: char[16]
    b.extra("<III", 2, 1, 16)
    b.add(Kind.STRUCT, "task", 64, vlen=5, flag=True)  # 5: bitfield offsets in members
    b.member("pid", 1, 0)
    b.member("flags", 1, 3 << 24 | 32)  # int flags:3 at bit 32
    b.member("", 6, 64)  # an anonymous union at byte 8
    b.member("comm", 8, 192)  # comm_t at byte 24
    b.member("parent", 9, 320)  # const volatile pointer at byte 40
    b.add(Kind.UNION, "", 16, vlen=2)  # 6
    b.member("", 7, 0)
    b.member("raw", 1, 0)
    b.add(Kind.STRUCT, "", 16, vlen=2)  # 7
    b.member("a", 1, 0)
    b.member("mm", 11, 64)
    b.add(Kind.TYPEDEF, "comm_t", 4)  # 8
    b.add(Kind.CONST, "", 10)  # 9
    b.add(Kind.VOLATILE, "", 3)  # 10
    b.add(Kind.TYPE_TAG, "user", 12)  # 11
    b.add(Kind.RESTRICT, "", 3)  # 12
    b.add(Kind.ENUM, "state", 4, vlen=2, flag=True)  # 13: signed values
    b.extra("<Ii", b.name("RUNNING"), 0)
    b.extra("<Ii", b.name("DEAD"), -1)
    b.add(Kind.ENUM64, "big", 8, vlen=1)  # 14
    b.extra("<III", b.name("HUGE"), 0, 1 << 8)
    b.add(Kind.FWD, "later", 0)  # 15
    b.add(Kind.FUNC_PROTO, "", 1, vlen=2)  # 16: int (int a, struct task *b)
    b.extra("<II", b.name("a"), 1)
    b.extra("<II", b.name("b"), 3)
    b.add(Kind.FUNC, "do_thing", 16, vlen=1)  # 17: global linkage
    b.add(Kind.VAR, "cur", 3)  # 18
    b.extra("<I", 1)
    b.add(Kind.VAR, "hot", 5)  # 19
    b.extra("<I", 1)
    b.add(Kind.DATASEC, ".data..percpu", 128, vlen=2)  # 20
    b.extra("<III", 18, 0, 8)
    b.extra("<III", 19, 64, 64)
    b.add(Kind.FLOAT, "double", 8)  # 21
    b.add(Kind.DECL_TAG, "tag", 5)  # 22
    b.extra("<i", -1)
    b.add(Kind.UNION, "u", 4, vlen=1)  # 23
    b.member("x", 1, 0)
    return Btf(b.build())


def test_every_kind_is_read() -> None:
    btf = sample()
    assert len(btf) == 23
    kinds = [btf.type(i).kind for i in range(1, 24)]
    assert set(kinds) == set(Kind) - {Kind.VOID}
    assert btf.type(0).kind is Kind.VOID
    assert btf.type(5).name == "task" and btf.type(5).kind_flag
    assert btf.type(11).name == "user"
    with pytest.raises(KeyError):
        btf.type(24)


def test_members_offsets_and_bitfields() -> None:
    btf = sample()
    pid, flags = btf.members(5)[:2]
    assert (pid.name, pid.offset, pid.bitfield_size) == ("pid", 0, 0)
    assert (flags.bit_offset, flags.bitfield_size) == (32, 3)
    assert btf.offset_of("task.comm") == 24
    assert btf.array(btf.field("task.comm").type_id) == (2, 16)
    assert btf.size_of(btf.field("task.comm").type_id) == 16
    assert btf.resolve(btf.field("task.parent").type_id).kind is Kind.PTR  # through const, volatile


def test_members_inside_anonymous_unions_and_structs() -> None:
    btf = sample()
    assert btf.offset_of("task.raw") == 8  # in the anonymous union at 8
    assert btf.offset_of("task.a") == 8  # in the anonymous struct inside it
    assert btf.offset_of("task.mm") == 16
    assert btf.resolve(btf.field("task.mm").type_id).kind is Kind.PTR  # through tag, restrict
    assert btf.offset_of("u.x") == 0
    with pytest.raises(KeyError):
        btf.offset_of("task.missing")
    with pytest.raises(KeyError):
        btf.offset_of("task.parent.pid")  # pointers are not followed
    with pytest.raises(KeyError):
        btf.struct("nothing")


def test_sizes_enums_and_lookups() -> None:
    btf = sample()
    assert [btf.size_of(i) for i in (1, 2, 3, 5, 8, 9, 13, 14, 21)] == [4, 1, 8, 64, 16, 8, 4, 8, 8]
    assert btf.enum_values(13) == {"RUNNING": 0, "DEAD": -1}
    assert btf.enum_values(14) == {"HUGE": 1 << 40}
    assert btf.find("comm_t") == 8 and btf.find("later", Kind.FWD) == 15
    assert btf.find("do_thing", Kind.FUNC) == 17 and btf.find("nothing") is None
    with pytest.raises(KeyError):
        btf.size_of(17)


def test_percpu_variables() -> None:
    btf = sample()
    assert btf.percpu("cur") == (0, 3)
    assert btf.percpu("hot") == (64, 5)
    assert btf.datasec(".data..percpu") == {"cur": (0, 3), "hot": (64, 5)}
    with pytest.raises(KeyError):
        btf.percpu("current_task")


def test_malformed_sections() -> None:
    good = Blob()
    good.add(Kind.PTR, "", 0)
    data = good.build()
    assert len(Btf(data)) == 1
    with pytest.raises(BtfError):
        Btf(b"\x9f\xeb" + data[2:4])
    with pytest.raises(BtfError):
        Btf(struct.pack("<H", 0x9FEB) + data[2:])  # the other byte order
    with pytest.raises(BtfError):
        Btf(data[:30])  # the type section runs past the end
    bad = Blob()
    bad.add(Kind.PTR, "", 0)
    bad.types[4:8] = struct.pack("<I", 25 << 24)  # no such kind
    with pytest.raises(BtfError):
        Btf(bad.build())
    short = Blob()
    short.add(Kind.INT, "int", 4)  # its encoding word is missing
    with pytest.raises(BtfError):
        Btf(short.build())


# --- Debian's 6.12, against pahole and bpftool ------------------------------------------


def pahole_offsets(vmlinux: Path, struct_name: str) -> dict[str, int]:
    """Member name -> offset as ``pahole -C`` prints it (first occurrence of each name)."""
    assert shutil.which("pahole"), "pahole (Debian's dwarves) is missing: scripts/setup installs it"
    out = subprocess.run(
        ["pahole", "-F", "btf", "-C", struct_name, str(vmlinux)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found: dict[str, int] = {}
    for m in re.finditer(r"[\s*](\w+)(?:\[\d+\])*;\s*/\*\s*(\d+)\s+\d+\s*\*/", out):
        found.setdefault(m[1], int(m[2]))
    return found


def bpftool_percpu(vmlinux: Path) -> dict[str, int]:
    tool = shutil.which("bpftool") or shutil.which("bpftool", path="/usr/sbin:/sbin")
    assert tool is not None, "bpftool is missing: scripts/setup installs it"
    out = subprocess.run(
        [tool, "btf", "dump", "file", str(vmlinux), "format", "raw"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    section = out.split("DATASEC '.data..percpu'", 1)[1].split("\n[", 1)[0]
    return {m[2]: int(m[1]) for m in re.finditer(r"offset=(\d+) size=\d+ \(VAR '(\w+)'\)", section)}


def test_debian_612_offsets_equal_pahole(linux_vmlinux_path: Path) -> None:
    image = ElfImage.load(linux_vmlinux_path)
    btf = Btf.from_image(image)
    assert btf is not None and len(btf) > 50_000
    task = pahole_offsets(linux_vmlinux_path, "task_struct")
    for name in ("pid", "tgid", "comm", "mm", "real_parent", "thread_pid"):
        assert btf.offset_of(f"task_struct.{name}") == task[name], name
    assert btf.offset_of("mm_struct.pgd") == pahole_offsets(linux_vmlinux_path, "mm_struct")["pgd"]
    hot = pahole_offsets(linux_vmlinux_path, "pcpu_hot")
    assert btf.offset_of("pcpu_hot.current_task") == hot["current_task"]
    comm = btf.field("task_struct.comm").type_id
    element, count = btf.array(comm)
    assert count == 16 and btf.resolve(element).name == "char" and btf.size_of(comm) == 16
    assert btf.size_of(btf.struct("task_struct").id) == btf.struct("task_struct").ref
    offset, type_id = btf.percpu("pcpu_hot")
    assert offset == bpftool_percpu(linux_vmlinux_path)["pcpu_hot"]
    assert btf.resolve(type_id).name == "pcpu_hot"
