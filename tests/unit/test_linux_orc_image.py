"""ORC tables of a real distribution kernel (Debian's 6.12): sorted, every field in range, the
6.4 layout recognised, and a C function's first instruction described as a plain call frame."""

from __future__ import annotations

import struct
from pathlib import Path

import linuxkernel
import pytest

from qmpprof.elf.image import ElfImage
from qmpprof.linux.x86_64.orctables import (
    CLASSIC,
    RENUMBERED,
    OrcLayout,
    OrcTable,
    OrcType,
    core_of,
    decode_entry,
    known_numbering,
    numbering,
)


def exported_functions(image: ElfImage) -> list[int]:
    """The addresses in .text of the symbols in ``__ksymtab``/``__ksymtab_gpl``: with
    PREL32 relocations each entry is three s32 (value, name, namespace), relative to themselves."""
    text = image.section_addr(".text") or 0
    starts = []
    for name in ("__ksymtab", "__ksymtab_gpl"):  # (7.x has no __ksymtab_gpl)
        data, addr = image.section(name), image.section_addr(name)
        if data is None or addr is None:
            continue
        for i, (value, _name, _ns) in enumerate(struct.iter_unpack("<iii", data)):
            target = addr + 12 * i + value
            if text <= target < text + image.text_size:
                starts.append(target)
    return starts


def test_debian_612_tables(linux_vmlinux_path: Path) -> None:
    image = ElfImage.load(linux_vmlinux_path)
    table = OrcTable.from_image(image)
    assert table is not None and table.layout is OrcLayout.SIGNAL
    ip_bytes = image.section(".orc_unwind_ip")
    assert ip_bytes is not None and len(table) == len(ip_bytes) // 4 > 300_000
    assert all(a <= b for a, b in zip(table.offsets, table.offsets[1:], strict=False))
    assert table.ip(0) == image.section_addr(".text")
    raw = image.section(".orc_unwind")
    assert raw is not None
    for bits in {field for _, _, field in struct.iter_unpack("<hhH", raw)}:
        entry = decode_entry(0, 0, bits, table.layout)  # ValueError for a type out of range
        assert 0 <= entry.sp_reg <= 9, hex(bits)  # CLASSIC's highest, SP_INDIRECT
        assert entry.bp_reg in (CLASSIC.undefined, CLASSIC.prev_sp, CLASSIC.bp), hex(bits)
    starts = exported_functions(image)
    assert len(starts) > 5000
    plain = [table.lookup(pc) for pc in starts]
    calls = [e for e in plain if e is not None and e.type is OrcType.CALL]
    assert all(e.sp_reg == CLASSIC.sp and e.sp_offset == 8 for e in calls)
    # The rest are the few exported assembly routines objtool leaves undefined (thunks).
    assert len(calls) >= 0.99 * len(starts)


@pytest.mark.parametrize("series", ["6.1", "5.10"])
def test_debian_older_tables_use_the_legacy_layout(series: str) -> None:
    """Debian's 6.1 and 5.10 kernels (scripts/fetch-linux 6.1, 5.10): the layout before 6.4."""
    image = linuxkernel.vmlinux(series)
    table = OrcTable.from_image(image)
    assert table is not None and table.layout is OrcLayout.LEGACY
    entries = [table.lookup(pc) for pc in exported_functions(image)]
    calls = [e for e in entries if e is not None and e.type is OrcType.CALL]
    assert all(e.sp_reg == CLASSIC.sp and e.sp_offset == 8 and not e.signal for e in calls)
    assert len(calls) >= 0.99 * len(entries)


@pytest.mark.parametrize(("series", "expected"), [("6.12", CLASSIC), ("7", RENUMBERED)])
def test_the_numbering_is_the_one_the_tables_show(series: str, expected: object) -> None:
    """6.12 and 7.x number ORC's registers differently: each image's .orc_header names its
    numbering, and the entries themselves show the same one (how an unseen header is read)."""
    image = linuxkernel.vmlinux(series)
    table = OrcTable.from_image(image)
    assert table is not None
    starts = exported_functions(image)
    header = image.section(".orc_header")
    assert header is not None and numbering(header, table, starts) == (expected, None)
    assert core_of(table, starts) == (0, expected.prev_sp, expected.sp, expected.bp)  # type: ignore[attr-defined]
    assert known_numbering(header) == expected
    assert known_numbering(b"\0" * 20) is None
    unseen, note = numbering(b"\0" * 20, table, starts)
    assert unseen == expected and note is None
    assert numbering(None, table, starts) == (CLASSIC, None)  # before 6.4: no header


def test_a_numbering_no_kernel_had_is_said_and_its_core_used() -> None:
    image = linuxkernel.vmlinux("7")
    table = OrcTable.from_image(image)
    assert table is not None
    found, note = numbering(b"\1" * 20, table, exported_functions(image)[:10])
    assert found == CLASSIC and note is not None and "too few entries" in note
