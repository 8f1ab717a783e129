"""An arm64 kernel Image read as the ELF of its memory image at its link address: the header,
the EFI stub's PE sections, the relocations applied (the link address from their addends),
BTF by its header; bookworm's arm64 6.1 and 6.12 Images as shipped, loaded as a LinuxKernel
(kallsyms decoded by content), and Images built by hand for what must be refused."""

from __future__ import annotations

import struct

import pytest
from aarch64vm import image

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError
from qmpprof.linux import bannerslide
from qmpprof.linux.arm64image import elf_of_image, is_arm64_image
from qmpprof.linux.kernel import LinuxKernel

pytestmark = pytest.mark.linux

# Measured on the packages fetched here: where each is linked (KIMAGE_VADDR: 48-bit kernel
# VAs in 6.1, 52 in 6.12) and how many symbols its kallsyms hold.
LINKED = {"6.1": (0xFFFF_8000_0800_0000, 50_336), "6.12": (0xFFFF_8000_8000_0000, 151_594)}


@pytest.mark.parametrize("series", sorted(LINKED))
def test_bookworm_images_load_at_their_link_address(series: str) -> None:
    link, count = LINKED[series]
    kernel = LinuxKernel.load(image(series))
    assert kernel.image.arch is AARCH64
    assert kernel.image.load_range[0] == link
    assert len(kernel.symbols) == count
    # The PE .text starts at _stext, 64 KiB past _text: the head (header, EFI entry) before.
    assert kernel.symbols.address_of("_stext") == link + 0x10000
    assert kernel.image.text_addr == link
    assert kernel.span[0] == link
    assert kernel.btf is not None and kernel.btf.find("task_struct") is not None
    assert kernel.orc is None and kernel.missing[0].startswith("no ORC tables")
    # kallsyms_relative_base was patched by the relocations: every symbol is in the image
    # (6.12's data symbols too, up to _end: the header's image_size).
    end = kernel.image.load_range[1]
    assert all(link <= addr <= end for addr in kernel.symbols.addrs)
    assert kernel.symbols.address_of("_end") in (None, end)


def test_the_banner_is_in_the_read_only_data() -> None:
    kernel = LinuxKernel.load(image("6.1"))
    found = bannerslide.banner(kernel.image)
    assert found is not None
    addr, text = found
    assert text.startswith(b"Linux version 6.1.0-") and text.endswith(b"\n")
    assert kernel.image.section_addr(".rodata") is not None
    assert kernel.span[0] < addr < kernel.span[1]


def test_slide_candidates_keep_the_pc_in_the_image() -> None:
    span = (0xFFFF_8000_0800_0000, 0xFFFF_8000_0820_0000)  # 2 MiB: 32 steps of 64 KiB
    pc = 0xFFFF_A735_9381_0C80
    slides = bannerslide.candidates(pc, span)
    assert len(slides) == 32
    assert all(span[0] <= pc - s < span[1] for s in slides)
    assert all(s % bannerslide.ALIGN == 0 for s in slides)
    assert 0 in bannerslide.candidates(span[0] + 0x100, span)  # nokaslr: slide 0 is one


def tiny_image(relocs: list[tuple[int, int]], link: int = 0xFFFF_8000_0800_0000) -> bytes:
    """A 64 KiB Image: the header, a PE header with one .text section, ``relocs``
    (place, value) as R_AARCH64_RELATIVE entries at 0x4000."""
    data = bytearray(0x10000)
    struct.pack_into("<IIQQQ", data, 0, 0, 0, 0, len(data), 0xA)
    data[0x38:0x40] = b"ARM\x64" + struct.pack("<I", 0x40)
    data[0x40:0x44] = b"PE\0\0"
    struct.pack_into("<H", data, 0x46, 1)  # one section
    struct.pack_into("<H", data, 0x54, 0)  # no optional header
    struct.pack_into("<8sIIII", data, 0x58, b".text", 0xF000, 0x1000, 0xF000, 0x1000)
    for i, (place, value) in enumerate(relocs):
        struct.pack_into("<QQQ", data, 0x4000 + 24 * i, link + place, 1027, link + value)
    return bytes(data)


def test_a_hand_made_image_is_relocated() -> None:
    relocs = [(0x8000 + 8 * i, 0x1000 + i) for i in range(1000)] + [(0x9F00, 0)]
    elf = ElfImage.from_bytes("tiny", elf_of_image(tiny_image(relocs), "tiny"))
    assert elf.load_range == (0xFFFF_8000_0800_0000, 0xFFFF_8000_0801_0000)
    rodata = elf.section(".rodata")
    assert rodata is not None
    word = struct.unpack_from("<Q", rodata, 0x8008 - 0x1000)[0]
    assert word == 0xFFFF_8000_0800_1001  # place 0x8008 holds its value at the link address
    assert elf.section(".BTF") is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x7fELF" + bytes(100), "not an arm64 Image"),
        (tiny_image([]), "no relocation table"),
        (tiny_image([(0x8000 + 8 * i, 0x1000) for i in range(999)] + [(0x20000, 0)]), "outside"),
    ],
)
def test_what_is_not_an_arm64_image_is_one_clear_error(data: bytes, message: str) -> None:
    assert is_arm64_image(data) == (message != "not an arm64 Image")
    with pytest.raises(KernelImageError, match=message):
        elf_of_image(data, "bad")
