"""The kernel check's arm64 row (``support.kernelcheck``, what ``scripts/check-kernels --arch
arm64`` reports per kernel) on the kernel the tests have, in this process: the facts the Image
reader and BTF give, and the table line made of them. The fetch of the kernels the tests never
boot is not part of the tests (too large)."""

from __future__ import annotations

from pathlib import Path

import pytest
from aarch64vm import image
from kernelpack import zboot
from support.kernelcheck import one
from support.kerneltable import ARM64_COLUMNS, markdown_arm64

pytestmark = pytest.mark.linux


def test_the_arm64_row_of_bookworms_61(tmp_path: Path) -> None:
    packed = tmp_path / "vmlinuz.efi"
    packed.write_bytes(zboot(image("6.1").read_bytes(), "zstd"))
    rows = [one(image("6.1"), load_only=False), one(packed, load_only=False)]
    for row in rows:
        assert "error" not in row, row
        facts = row["image"]
        assert facts["page_size"] == 4096
        assert facts["link"] == "0xffff800008000000"
        assert facts["relocations"] == ("RELA", 187_633)
        assert facts["parts_aligned"]
        assert facts["exception_code"]  # the walk's model of its exception code
        assert facts["banner"] == "6.1"
        assert row["kallsyms"]["symbols"] == 50_336
        assert row["btf"]["task"] and row["btf"]["module"] == "core_layout"
        assert row["btf"]["vma"] == "maple"
    assert [row["image"]["form"] for row in rows] == ["Image", "zboot (zstd22)"]
    # The zboot payload is the Image padded to image_size: .bss too.
    assert rows[1]["image"]["image_bytes"] == rows[0]["image"]["image_size"]
    lines = markdown_arm64([{"path": "x", "version": "6.1.0-56-arm64", **row} for row in rows])
    cells = [line.split(" | ") for line in lines.splitlines()[2:]]
    assert [len(c) for c in cells] == [len(ARM64_COLUMNS)] * 2
    assert cells[1][2].startswith("zboot (zstd22) (") and cells[1][3] == "4 KiB"
    assert cells[0][6] == "RELA 187 633"
    assert "exception model: pt_regs 336 bytes, record at 0x130: {x29, pc}" in cells[0][-1]
    shape = "pc saved after it, returns through a branch"
    assert f"vectors+0x200-0x380 known: record {{x29, pc}}, {shape}" in cells[0][-1]
    assert f"vectors+0x400-0x780 known: record zeroed, {shape}" in cells[0][-1]
    entries = [dict(e) for e in facts["exception_entries"]]
    entries[1] |= {"known": False, "shape": "no add x29, sp, #0x130 (pt_regs' record)"}
    unread = markdown_arm64(
        [
            {
                "path": "x",
                **rows[0],
                "image": facts | {"exception_code": False, "exception_entries": entries},
            }
        ]
    )
    assert "no exception model" in unread
    assert "vectors+0x200 known" in unread and "vectors+0x280 UNKNOWN: no add x29" in unread
    assert f"vectors+0x300-0x380 known: record {{x29, pc}}, {shape}" in unread
    assert cells[0][9].startswith("`_einittext+")  # __entry_task: 6.1's kallsyms name no data
    # The per-CPU symbols read in the code, and those the run takes, are the kernel's own (its
    # debug vmlinux's, scripts/fetch-linux-dbg; the zboot image's folder has none).
    oracle = rows[0]["per_cpu_oracle"]
    assert oracle["source"] == "vmlinux-dbg" and oracle["differs"] == []
    assert oracle["oracle"] == {
        "__per_cpu_start": "0xffff800009804000",
        "__per_cpu_offset": "0xffff800009cc3010",
        "__entry_task": "0xffff800009804308",
    }
    assert oracle["code"] == oracle["run"] == rows[1]["per_cpu_oracle"]["code"]
    assert [c[10] for c in cells] == ["agree (vmlinux-dbg)", "no System.map"]
