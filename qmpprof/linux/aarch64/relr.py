"""The RELR relocations of an arm64 Image (CONFIG_RELR: every Debian arm64 kernel from trixie's
6.12 on, linked by a binutils that packs relative relocations) and the link address they give.

A relocatable Image lists the places KASLR must move. Older toolchains write them as
``Elf64_Rela`` entries with the value in the addend (``kernelimage``); with RELR the list is a
run of u64 words (the ELF gABI's SHT_RELR; ``.relr.dyn``, ``__relr_start`` in vmlinux.lds.S):
an even word is a place, and each odd word after it a bitmap whose bits 1..63 mark the 63 words
after the last one covered, as places too. A place's value is in the image itself (RELR has no
addend). Nothing in the Image says where the run is: it is the longest run of words of that
form (places ascending, 8-aligned, in the upper half) that holds at least one bitmap. Measured
on Debian's 7.2.13+deb14-arm64: 358 952 places in 15 039 words, after a small ``.rela.dyn`` of
R_AARCH64_ABS64 entries.

The link address (of ``_text``) is then the one 64 KiB-aligned address (a segment's alignment)
at which every place lies in the image and holds an address in it or 0 (357 places of
7.2.13+deb14-arm64 read 0 in the file), the smallest of them ``_text`` itself
(``kimage_vaddr`` holds it).
"""

from __future__ import annotations

import struct
from array import array

_UPPER = 0xFFFF_0000_0000_0000  # a place in the kernel's half, whatever its VA size
_ALIGN = 0x10000  # the link address's alignment: the Image's segments' (SEGMENT_ALIGN)
_MAX_IMAGE = 256 << 20  # no Image is larger (bzimage.MAX_VMLINUX)
_SAMPLE = 64  # places checked at each candidate link address before all are
_WORD = struct.Struct("<Q")


def relr_places(image: bytes | bytearray) -> list[int]:
    """The places (link addresses, ascending) of the image's RELR run; [] when it has none."""
    words = array("Q")
    words.frombytes(bytes(image[: len(image) // 8 * 8]))
    best, best_count = (0, 0), 0
    start, count, bitmaps, covered = -1, 0, 0, 0
    for i, word in enumerate(words):
        if word & 1 and start >= 0:
            count += (word >> 1).bit_count()
            bitmaps += 1
            covered += 63 * 8
            continue
        if not word & 7 and word >= _UPPER and start >= 0 and word >= covered:
            count, covered = count + 1, word + 8
            continue
        if start >= 0 and bitmaps and count > best_count:
            best, best_count = (start, i), count
        start, count, bitmaps = -1, 0, 0
        if not word & 7 and word >= _UPPER:
            start, count, covered = i, 1, word + 8
    if start >= 0 and bitmaps and count > best_count:
        best = (start, len(words))
    return _decode(words[best[0] : best[1]])


def _decode(words: array[int]) -> list[int]:
    places: list[int] = []
    where = 0
    for word in words:
        if word & 1:
            bits = word >> 1
            places += [where + 8 * k for k in range(63) if bits >> k & 1]
            where += 63 * 8
        else:
            places.append(word)
            where = word + 8
    return places


def relr_link(image: bytes | bytearray, places: list[int], image_size: int) -> list[int]:
    """The link addresses at which the RELR ``places`` fit the image (one, or the image is
    not what they relocate)."""
    low, high = places[0], places[-1]
    span = min(image_size, _MAX_IMAGE)  # a damaged header's size must not make the search long
    first = -(-(high + 8 - span) // _ALIGN) * _ALIGN
    sample = places[:: max(1, len(places) // _SAMPLE)]
    found = []
    for link in range(first, low - low % _ALIGN + 1, _ALIGN):
        if _fits(image, sample, link, image_size) and _fits(image, places, link, image_size):
            found.append(link)
    return found


def _values(image: bytes | bytearray, places: list[int], link: int) -> list[int]:
    """The non-zero words at ``places`` in the file (those past its end are .bss)."""
    inside = [p - link for p in places if p - link + 8 <= len(image)]
    return [v for v in (_WORD.unpack_from(image, at)[0] for at in inside) if v] or [0]


def _fits(image: bytes | bytearray, places: list[int], link: int, image_size: int) -> bool:
    """Whether each of ``places`` in the file holds 0 or an address in the image linked at
    ``link``."""
    if places[0] < link:
        return False
    return all(link <= value < link + image_size for value in _values(image, places, link))
