"""The damage fuzzing once found escaping as tracebacks (issue 23), one case each, and the
decompression bombs: each is now the project's own error, a note, or an ignored cache entry."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import linuxkernel
import pytest
import zstandard
from kernelpack import COMPRESSORS
from test_linux_btf import Blob
from test_linux_bzimage import bzimage

from qmpprof.errors import KernelImageError
from qmpprof.linux import bzimage as bzimage_module
from qmpprof.linux import cache
from qmpprof.linux.aarch64.kernelimage import elf_of_image
from qmpprof.linux.btf import Btf, BtfError, Kind
from qmpprof.linux.bzimage import MAX_VMLINUX, vmlinux_bytes
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.guest import Layouts
from qmpprof.linux.running.vma import VmaLayout, read_exec_vmas


@pytest.fixture(scope="module")
def vmlinux() -> bytes:
    return vmlinux_bytes((linuxkernel.linux_dir("6.12") / "vmlinuz").read_bytes())


def with_section_size(elf: bytes, name: bytes, delta: int) -> bytes:
    """An ELF64 with one section's sh_size changed by ``delta``."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    (names_at,) = struct.unpack_from("<Q", elf, shoff + shstrndx * shentsize + 0x18)
    out = bytearray(elf)
    for i in range(shnum):
        at = shoff + i * shentsize
        (name_off,) = struct.unpack_from("<I", elf, at)
        if elf[names_at + name_off :].startswith(name + b"\0"):
            (size,) = struct.unpack_from("<Q", elf, at + 0x20)
            struct.pack_into("<Q", out, at + 0x20, size + delta)
            return bytes(out)
    raise AssertionError(f"no section {name!r}")


def test_orc_entries_not_six_bytes_per_ip_are_a_kernel_image_error(
    vmlinux: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(with_section_size(vmlinux, b".orc_unwind", -6))
    with pytest.raises(KernelImageError, match=r"unreadable ORC tables: .* ORC ips but"):
        LinuxKernel.load(path)


def self_containing() -> Btf:
    b = Blob()
    b.add(Kind.INT, "int", 4)  # 1
    b.extra("<I", 32)
    b.add(Kind.STRUCT, "loop", 8, vlen=2)  # 2: an anonymous member of its own type
    b.member("", 2, 0)
    b.member("x", 1, 0)
    b.add(Kind.ARRAY, "", 0)  # 3: an array of itself
    b.extra("<III", 3, 1, 4)
    return Btf(b.build())


def test_a_btf_type_that_contains_itself_is_a_btf_error() -> None:
    btf = self_containing()
    with pytest.raises(BtfError, match="cycle"):
        btf.member(2, "absent")  # once: RecursionError in Btf._search
    with pytest.raises(BtfError, match="array of itself"):
        btf.size_of(3)  # once: RecursionError in Btf.size_of


@pytest.fixture(scope="module")
def kernel() -> LinuxKernel:
    return LinuxKernel.load(linuxkernel.linux_dir("6.12") / "vmlinuz")


def btf_section(kernel: LinuxKernel) -> tuple[Btf, bytearray]:
    assert kernel.btf is not None
    data = kernel.image.section(".BTF")
    assert data is not None
    return kernel.btf, bytearray(data)


def test_task_struct_containing_itself_is_a_note_of_the_layouts(kernel: LinuxKernel) -> None:
    btf, data = btf_section(kernel)
    task = btf.struct("task_struct")
    pid = [m.name for m in btf.members(task.id)].index("pid")
    at = btf.index.starts[task.id] + 12 + 12 * pid
    struct.pack_into("<II", data, at, 0, task.id)  # pid: now an anonymous task_struct
    layouts = Layouts.of(replace(kernel, btf=Btf(bytes(data), btf.index)))
    assert layouts.tasks is None
    assert any("unreadable BTF" in note and "cycle" in note for note in layouts.notes)


def test_a_cached_btf_index_over_changed_bytes_is_a_note(kernel: LinuxKernel) -> None:
    btf, data = btf_section(kernel)
    task = btf.struct("task_struct")
    info_at = btf.index.starts[task.id] + 4
    data[info_at + 3] = 24  # kind 24: "24 is not a valid Kind" once
    layouts = Layouts.of(replace(kernel, btf=Btf(bytes(data), btf.index)))
    assert layouts.tasks is None
    assert any("kind 24, not the one indexed" in note for note in layouts.notes)


@pytest.mark.parametrize(
    "head",
    [b"[]", b"1", b'"text"', b'{"version": 4, "count": "many", "names": 1}',
     b'{"version": 4, "meta": [], "parts": []}', b'{"version": 4, "meta": {}, "parts": [7]}',
     b"[" * 100_000],
)  # fmt: skip
def test_a_cache_entry_whose_header_is_not_the_expected_object_is_ignored(
    head: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: LinuxKernel
) -> None:
    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(tmp_path))
    cache.store("b" * 64, None, kernel.symbols)
    folder = cache.entry("b" * 64)
    for name in ("symbols.bin", "index.bin"):
        (folder / name).write_bytes(len(head).to_bytes(4, "little") + head + b"\0" * 64)
    assert cache.load_symbols("b" * 64) is None
    assert cache.load_index("b" * 64) is None


def zeros_zstd(size: int) -> bytes:
    """A zstd frame of ``size`` zero bytes after an ELF magic, compressed a MiB at a time."""
    packer = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    parts = [packer.compress(b"\x7fELF")]
    parts += [packer.compress(bytes(1 << 20)) for _ in range(size >> 20)]
    return b"".join([*parts, packer.flush()])


def test_a_zstd_bomb_stops_at_the_bound() -> None:
    payload = zeros_zstd(MAX_VMLINUX + (8 << 20))
    assert len(payload) < 64 << 10  # a few kilobytes that claim more than the bound
    with pytest.raises(KernelImageError, match="unpacks to more than 256 MiB: not a kernel"):
        vmlinux_bytes(bzimage(payload), "bomb")


def test_a_zstd_bomb_in_an_arm64_zboot_image_or_compressed_whole_stops_at_the_bound() -> None:
    payload = zeros_zstd(MAX_VMLINUX + (8 << 20))
    header = bytearray(0x1000)
    struct.pack_into("<4s4sII", header, 0, b"MZ\0\0", b"zimg", len(header), len(payload))
    header[24:32] = b"zstd22\0\0"
    for data in (bytes(header) + payload + bytes(4), payload):
        with pytest.raises(KernelImageError, match="unpacks to more than 256 MiB: not a kernel"):
            elf_of_image(data, "bomb")


@pytest.mark.parametrize("codec", sorted(COMPRESSORS))
def test_every_codec_stops_at_the_bound(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the bound lowered to 1 MiB (the real bound, as above, takes a while per codec)."""
    monkeypatch.setattr(bzimage_module, "MAX_VMLINUX", 1 << 20)
    payload = COMPRESSORS[codec](b"\x7fELF" + bytes(12 << 20))
    with pytest.raises(KernelImageError, match="unpacks to more than 1 MiB"):
        vmlinux_bytes(bzimage(payload), "bomb")
    small = COMPRESSORS[codec](b"\x7fELF" + bytes(1 << 19))
    assert len(vmlinux_bytes(bzimage(small), "fits")) == 4 + (1 << 19)


NODE = 0xFFFF_8880_0100_0000


def test_a_maple_tree_whose_nodes_loop_ends(kernel: LinuxKernel) -> None:
    layout = Layouts.of(kernel).vmas
    assert isinstance(layout, VmaLayout) and layout.maple
    node = NODE | layout.types[1] << 3 | 2  # a maple_range_64, internal

    async def loop_of_nodes(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        """Guest memory where every word points to the one node there is."""
        return [node.to_bytes(8, "little") * (size // 8) for _, size in ranges]

    assert asyncio.run(read_exec_vmas(loop_of_nodes, NODE, layout, 1 << 47)) == []
