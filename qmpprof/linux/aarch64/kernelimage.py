"""An arm64 kernel ``Image`` (what Debian ships as /boot/vmlinuz-*-arm64) -> an ELF of it at its
link address, which the rest of ``qmpprof.linux`` reads as it reads an x86 vmlinux.

Distributions ship the Image in one of three forms, told apart by their first bytes:

- the plain Image (Debian);
- the Image compressed whole (``Image.gz``: Ubuntu and many others; arch/arm64/boot/Makefile
  also makes ``Image.bz2``, ``.lz4``, ``.lzma``, ``.lzo`` and ``.zst``): the stream's magic;
- an EFI zboot image (CONFIG_EFI_ZBOOT; drivers/firmware/efi/libstub/zboot-header.S): a small
  PE/COFF program holding the compressed Image. Its header: ``MZ`` at 0, ``zimg`` at 4, the
  payload's offset and size as u32 at 8 and 12, the codec's name NUL-terminated at 24
  (``gzip``, ``lz4``, ``lzma``, ``lzo``, ``xzkern``, ``zstd22``: Makefile.zboot). The payload
  is the Image padded to its ``image_size`` (.bss as zeros); its size leaves out the 4 bytes of
  unpacked size appended after it (gzip's own trailer is counted).

The compressed ones are unpacked by the codecs the bzImage reader has (``bzimage.unpacked``).

The Image is the kernel's memory image from ``_text`` on, not an ELF: a 64-byte header
(Documentation/arch/arm64/booting.rst: ``text_offset`` and ``image_size`` as u64 at 8 and 16,
the magic ``ARM\\x64`` at 0x38, the PE header's offset at 0x3c), then the code. What it does
not say is read from its own contents:

- the EFI stub's PE section table names two sections by offset from ``_text``: ``.text``
  (``_stext`` up to the init data: code, read-only data and init code) and ``.data``; the ELF
  written here has ``.text`` from ``_text`` to the init data, ``.rodata`` from ``_stext`` (the
  kallsyms tables are found there), ``.data`` and ``.BTF``;
- the link address comes from the relocations a relocatable kernel (every arm64 distribution
  kernel: KASLR) carries for itself: a run of ``Elf64_Rela`` entries of type
  R_AARCH64_RELATIVE, each a link address to patch and the link address to put there. No
  pointer of the image points below ``_text`` (``kimage_vaddr`` holds ``_text`` itself), so the
  smallest upper-half addend is ``_text``'s link address; every patched place must then lie in
  the image (``image_size``), or the run is not the image's relocations.
- The image is linked with ``--no-apply-dynamic-relocs``: the patched words read 0 in the file
  (``kallsyms_relative_base`` among them). They are patched here, as the kernel patches itself
  at boot before the KASLR slide, so the bytes are the image's at its link address.
- Kernels linked with packed relative relocations (CONFIG_RELR: Debian's from trixie's 6.12
  on) have no such run but a RELR one, whose places hold their values already; the link
  address is the one at which those fit (``relr``).
- ``.BTF`` is found by its header (magic 0xeb9f, version 1, a 24-byte header whose lengths give
  the section's).

The header's flags (at 24) say the page size the kernel was built for (bits 1-2: 4, 16 or 64
KiB; 0: not said), which ``page_size`` reads.
"""

from __future__ import annotations

import struct

from qmpprof.errors import KernelImageError
from qmpprof.linux.aarch64.relr import relr_link, relr_places
from qmpprof.linux.bzimage import payload_codec, unpacked

_MAGIC_AT, _MAGIC = 0x38, b"ARM\x64"
_HEADER = struct.Struct("<IIQQQ")  # code0, code1, text_offset, image_size, flags
_RELA = struct.Struct("<QQQ")  # r_offset, r_info, r_addend
_RELATIVE_INFO = struct.pack("<Q", 1027)  # R_AARCH64_RELATIVE, symbol 0
_MIN_RELOCS = 1000  # a run shorter than this is a coincidence of bytes, not the table
_UPPER_HALF = 1 << 55  # bit 55 set: an address in the kernel's half
_BTF_HEADER = struct.Struct(
    "<HBBIIIII"
)  # magic, version, flags, hdr_len, type_off/len, str_off/len
_BTF_MAGIC = b"\x9f\xeb\x01\x00\x18\x00\x00\x00"  # magic, version 1, flags 0, hdr_len 24
_EM_AARCH64 = 183
_PAGE = 0x1000  # where the image starts in the ELF written here
_ZBOOT = struct.Struct("<2s2x4sII8x32s")  # "MZ", "zimg", payload offset and size, codec name
_ZBOOT_CODECS = {"xzkern": "xz", "zstd22": "zstd"}  # Makefile.zboot's names that are not ours
_PAGE_SIZES = {1: 4 << 10, 2: 16 << 10, 3: 64 << 10}  # the flags' bits 1-2


def is_arm64_image(head: bytes) -> bool:
    """Whether ``head`` starts a plain Image."""
    return head[_MAGIC_AT : _MAGIC_AT + 4] == _MAGIC


def is_zboot(head: bytes) -> bool:
    return head[:2] == b"MZ" and head[4:8] == b"zimg"


def is_arm64_kernel(head: bytes) -> bool:
    """Whether a file starting with ``head`` is read as an arm64 Image: a plain one, an EFI
    zboot image, or a file compressed whole (qmpprof reads no other compressed kernel)."""
    return is_arm64_image(head) or is_zboot(head) or payload_codec(head) is not None


def form(head: bytes) -> str:
    """How a file starting with ``head`` holds its Image: "Image", "zboot (gzip)" (the codec
    the zboot header names), "gzip-compressed Image"; "?" for none of those."""
    if is_arm64_image(head):
        return "Image"
    if is_zboot(head) and len(head) >= _ZBOOT.size:
        return f"zboot ({_zboot_codec(head)})"
    codec = payload_codec(head)
    return "?" if codec is None else f"{codec}-compressed Image"


def page_size(data: bytes) -> int | None:
    """The page size the Image's header says its kernel was built for (None: not said)."""
    (flags,) = struct.unpack_from("<Q", data, 24)
    return _PAGE_SIZES.get((flags >> 1) & 3)


def plain_image(data: bytes, path: str = "<kernel>") -> bytes:
    """The plain Image in the file ``data`` (any of the three forms)."""
    if is_arm64_image(data):
        return data
    if is_zboot(data) and len(data) >= _ZBOOT.size:
        image = _zboot_payload(data, path)
    elif payload_codec(data) is not None:
        image, _ = unpacked(data, path, "compressed Image")
    else:
        raise KernelImageError(path, "not an arm64 Image (no ARM\\x64 magic at 0x38)")
    if len(image) < 0x40 or not is_arm64_image(image):
        what = "zboot payload" if is_zboot(data) else "compressed file"
        raise KernelImageError(path, f"the {what} unpacks to something other than an arm64 Image")
    return image


def _zboot_payload(data: bytes, path: str) -> bytes:
    """The unpacked payload of an EFI zboot image, its codec checked against the header's."""
    offset, size = _ZBOOT.unpack_from(data)[2:4]
    named = _zboot_codec(data)
    if size == 0 or offset + size > len(data):
        raise KernelImageError(path, "zboot payload runs past the end of the file")
    image, codec = unpacked(data[offset : offset + size], path, f"zboot payload ({named})")
    if _ZBOOT_CODECS.get(named, named) != codec:
        raise KernelImageError(path, f"zboot header says {named!r}, its payload is {codec}")
    return image


def _zboot_codec(data: bytes) -> str:
    """The codec's name in a zboot header."""
    name: bytes = _ZBOOT.unpack_from(data)[4]
    return name.split(b"\0")[0].decode("ascii", "replace")


def elf_of_image(data: bytes, path: str = "<kernel>") -> bytes:
    """An ELF (one PT_LOAD at the link address, the sections of the module's docstring)
    holding the Image in the file ``data`` (any of the three forms) with its relocations
    applied."""
    data = plain_image(data, path)
    try:
        return _elf_of_plain(data, path)
    except (struct.error, ValueError, OverflowError) as err:  # fields pointing past the data
        raise KernelImageError(path, f"damaged Image ({err})") from err


def _elf_of_plain(data: bytes, path: str) -> bytes:
    _code0, _code1, _text_offset, image_size, _flags = _HEADER.unpack_from(data)
    sections = _pe_sections(data, path)
    if ".text" not in sections:
        raise KernelImageError(path, "the Image's PE header names no .text section")
    image = bytearray(data)
    link = _relocate(image, image_size, path)
    # .text from _text, as a vmlinux's: the head (the header, the EFI stub's entry) is code too.
    text_start, text_size = sections[".text"]
    named = [(".text", 0x6, 0, text_start + text_size), (".rodata", 0x2, text_start, text_size)]
    if ".data" in sections:
        named.append((".data", 0x3, *sections[".data"]))
    btf = _btf_range(image)
    if btf is not None:
        named.append((".BTF", 0x2, *btf))
    return _elf(bytes(image), link, image_size, named)


def _pe_sections(data: bytes, path: str) -> dict[str, tuple[int, int]]:
    """The PE section table's (offset from ``_text``, size in the file) by name."""
    (pe,) = struct.unpack_from("<I", data, 0x3C)
    if data[pe : pe + 4] != b"PE\0\0":
        raise KernelImageError(path, "the Image has no PE header (an EFI stub) to read")
    count, optional = (
        struct.unpack_from("<H", data, pe + 6)[0],
        struct.unpack_from("<H", data, pe + 20)[0],
    )
    table = pe + 24 + optional
    out: dict[str, tuple[int, int]] = {}
    for i in range(count):
        name, size, vaddr, raw_size = struct.unpack_from("<8sIII", data, table + 40 * i)
        size = min(size, raw_size, len(data) - vaddr)  # .data's .bss is not in the file
        out.setdefault(name.rstrip(b"\0").decode("ascii", "replace"), (vaddr, size))
    return out


def _relocate(image: bytearray, image_size: int, path: str) -> int:
    """Apply the image's R_AARCH64_RELATIVE relocations at its link address; return that.
    An image whose relocations are RELR (``relr``) holds their values already."""
    start, count = relocation_run(image)
    if count < _MIN_RELOCS:
        return _relr_link(image, image_size, path)
    entries = [_RELA.unpack_from(image, start + i * _RELA.size) for i in range(count)]
    upper = [addend for _, _, addend in entries if addend & _UPPER_HALF]
    if not upper:
        raise KernelImageError(path, "the Image's relocations point nowhere in the kernel's half")
    link = int(min(upper))
    places = [offset - link for offset, _, _ in entries]
    if min(places) < 0 or max(places) + 8 > image_size:
        raise KernelImageError(path, f"relocations outside the Image linked at {link:#x}")
    for place, (_, _, addend) in zip(places, entries, strict=True):
        if place + 8 <= len(image):  # the rest is in .bss, beyond the file
            struct.pack_into("<Q", image, place, addend)
    return link


def relocations(image: bytes | bytearray) -> tuple[str, int]:
    """The kind of the image's relocations ("RELA", "RELR"; "none") and how many places."""
    count = relocation_run(image)[1]
    if count >= _MIN_RELOCS:
        return "RELA", count
    places = len(relr_places(image))
    return ("RELR", places) if places >= _MIN_RELOCS else ("none", 0)


def _relr_link(image: bytearray, image_size: int, path: str) -> int:
    places = relr_places(image)
    if len(places) < _MIN_RELOCS:
        raise KernelImageError(
            path, "no relocation table (RELA or RELR) in the Image: its link address unknown"
        )
    links = relr_link(image, places, image_size)
    if len(links) != 1:
        raise KernelImageError(
            path, f"the Image's RELR relocations fit {len(links)} link addresses, not one"
        )
    return links[0]


def relocation_run(image: bytes | bytearray) -> tuple[int, int]:
    """(file offset, entries) of the longest run of 8-aligned R_AARCH64_RELATIVE entries."""
    best = (0, 0)
    run_start, run_len, last = 0, 0, -1
    pos = image.find(_RELATIVE_INFO)
    while pos != -1:
        if pos % 8 == 0 and pos >= 8:
            entry = pos - 8
            if entry == last + _RELA.size:
                run_len += 1
            else:
                run_start, run_len = entry, 1
            last = entry
            if run_len > best[1]:
                best = (run_start, run_len)
            pos = image.find(_RELATIVE_INFO, pos + _RELA.size - 8)
        else:
            pos = image.find(_RELATIVE_INFO, pos + 1)
    return best


def _btf_range(image: bytearray) -> tuple[int, int] | None:
    """(offset, size) of the BTF blob: the first header whose lengths fit in the image."""
    pos = image.find(_BTF_MAGIC)
    while pos != -1:
        fields = _BTF_HEADER.unpack_from(image, pos)
        hdr_len, type_off, type_len, str_off, str_len = fields[3:]
        size = hdr_len + max(type_off + type_len, str_off + str_len)
        if type_len and str_len and pos + size <= len(image):
            return pos, size
        pos = image.find(_BTF_MAGIC, pos + 1)
    return None


def _elf(image: bytes, link: int, mem_size: int, named: list[tuple[str, int, int, int]]) -> bytes:
    """An ELF64 of ``image`` loaded at ``link`` (``mem_size`` bytes in memory) with sections
    ``named`` (name, flags, offset in the image, size)."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name, *_ in named) + b".shstrtab\0"
    body = _PAGE + len(image)
    strtab_at = body
    shoff = (strtab_at + len(names) + 7) & ~7
    shdrs = [bytes(64)]
    name_at = 1
    for name, flags, offset, size in named:
        shdrs.append(
            struct.pack(
                "<IIQQQQIIQQ", name_at, 1, flags, link + offset, _PAGE + offset, size, 0, 0, 8, 0
            )
        )
        name_at += len(name) + 1
    shdrs.append(struct.pack("<IIQQQQIIQQ", name_at, 3, 0, 0, strtab_at, len(names), 0, 0, 1, 0))
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH", 2, _EM_AARCH64, 1, link, 64, shoff, 0, 64, 56, 1, 64, len(shdrs),
        len(shdrs) - 1,
    )  # fmt: skip
    phdr = struct.pack("<IIQQQQQQ", 1, 7, _PAGE, link, link, len(image), mem_size, 0x10000)
    out = bytearray(header + phdr)
    out += bytes(_PAGE - len(out)) + image + names
    out += bytes(shoff - len(out)) + b"".join(shdrs)
    return bytes(out)
