"""bzImage -> vmlinux: the real Debian kernel, and hand-built bzImage wrappers for every codec."""

from __future__ import annotations

import gzip
import os
import re
import struct
from pathlib import Path

import linuxkernel
import pytest
from kernelpack import COMPRESSORS, lz4_legacy, size_append

from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError
from qmpprof.linux.bzimage import bzimage_payload, payload_codec, vmlinux_bytes

# A stand-in for vmlinux: the ELF magic, then enough varied bytes to need real compression.
FAKE_ELF = b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 64 + os.urandom(4096)


def bzimage(payload: bytes, *, setup_sects: int = 3, version: int = 0x020F) -> bytes:
    """A bzImage-shaped file: boot sector and setup, then the protected-mode part, whose
    first 0x100 bytes stand for the decompressor and are followed by the payload."""
    setup = bytearray((setup_sects + 1) * 512)
    setup[0x1F1] = setup_sects
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, version)
    struct.pack_into("<II", setup, 0x248, 0x100, len(payload))
    return bytes(setup) + b"\xcc" * 0x100 + payload + b"\x00" * 64


@pytest.mark.parametrize("codec", sorted(COMPRESSORS))
def test_every_codec_unpacks_to_the_elf(codec: str) -> None:
    payload = COMPRESSORS[codec](FAKE_ELF) + size_append(FAKE_ELF)
    image = bzimage(payload)
    assert payload_codec(bzimage_payload(image)) == codec
    assert vmlinux_bytes(image) == FAKE_ELF


def test_lz4_legacy_reads_every_block() -> None:
    big = (os.urandom(1 << 20) + b"\0" * (1 << 20)) * 5  # 10 MiB: two legacy blocks
    elf = b"\x7fELF" + big
    assert vmlinux_bytes(bzimage(lz4_legacy(elf) + size_append(elf))) == elf


def test_setup_sects_zero_means_four() -> None:
    image = bytearray(bzimage(gzip.compress(FAKE_ELF), setup_sects=4))
    image[0x1F1] = 0
    assert vmlinux_bytes(bytes(image)) == FAKE_ELF


def test_an_elf_is_returned_as_it_is() -> None:
    assert vmlinux_bytes(FAKE_ELF) is FAKE_ELF


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"MZ" + b"\0" * 2000, "neither an ELF file nor a bzImage"),
        (bzimage(b"\x00" * 32, version=0x0206), "boot protocol 2.06 has no payload fields"),
        (bzimage(b"\x89LZO\x00" + b"\x00" * 32), "lzo-compressed, which is not read"),
        (bzimage(b"\x12\x34" * 16), "payload of unknown kind (starts 123412341234)"),
        (bzimage(gzip.compress(FAKE_ELF)[:-40]), "gzip payload does not unpack"),
        (bzimage(gzip.compress(b"not an elf")), "gzip payload unpacks to something other than"),
        (bzimage(lz4_legacy(FAKE_ELF)[:-9] + b"\x00" * 8), "lz4 payload does not unpack"),
    ],
)
def test_bad_images_say_why_in_one_line(data: bytes, message: str) -> None:
    with pytest.raises(KernelImageError) as caught:
        vmlinux_bytes(data, "vmlinuz")
    text = str(caught.value)
    assert text.startswith("vmlinuz: not a usable kernel image: ")
    assert message in text
    assert "\n" not in text


def test_a_payload_running_past_the_end_is_refused() -> None:
    image = bytearray(bzimage(gzip.compress(FAKE_ELF)))
    struct.pack_into("<I", image, 0x24C, len(image))
    with pytest.raises(KernelImageError, match="runs past the end"):
        vmlinux_bytes(bytes(image))


# The real kernel.


@pytest.mark.linux
@pytest.mark.parametrize(("series", "codec"), [("6.12", "zstd"), ("6.1", "xz"), ("5.10", "xz")])
def test_debian_payload_codec_is_the_one_its_config_chose(series: str, codec: str) -> None:
    folder = linuxkernel.linux_dir(series)
    config = (folder / "config").read_text()
    chosen = re.findall(r"^CONFIG_KERNEL_(GZIP|BZIP2|LZMA|XZ|LZO|LZ4|ZSTD)=y$", config, re.M)
    payload = bzimage_payload((folder / "vmlinuz").read_bytes())
    assert [payload_codec(payload)] == [c.lower() for c in chosen]
    assert chosen == [codec.upper()]  # Debian's choice; a change here is worth knowing about


@pytest.mark.linux
def test_debian_vmlinuz_unpacks_to_the_stripped_vmlinux(
    linux_dir: Path, linux_vmlinux: ElfImage
) -> None:
    data = (linux_dir / "vmlinuz").read_bytes()
    payload = bzimage_payload(data)
    # The size the build appended to the payload is the unpacked size.
    assert struct.unpack("<I", payload[-4:])[0] == len(vmlinux_bytes(data)) & 0xFFFFFFFF
    elf = linux_vmlinux
    assert elf.text_addr == 0xFFFFFFFF81000000
    for present in (".text", ".rodata", ".orc_unwind_ip", ".orc_unwind", ".BTF", "__ksymtab"):
        assert elf.section(present), present
    assert elf.section(".symtab") is None
    assert len(elf.symbols) == 0
