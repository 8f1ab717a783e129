"""The running kernel's KASLR slide where no IDT gives it away (arm64): found by where the
image's own ``linux_banner`` ("Linux version 6.1.0-56-arm64 (...) ...") reads in the guest.

A vCPU in the kernel runs the image's code at ``link + slide``: its pc ``p`` bounds the slide to
(``p`` - end of the image's code, ``p`` - start], in steps of the alignment every slide keeps.
The banner is read-only data (never patched at boot, unlike code), its link address is where the
image holds it: the slide is the candidate at which the guest holds the same bytes there. Only
one may: a second is the image mapped twice, which no kernel does, and is refused.

Pure: ``qmpprof.linux.running.slide`` reads the candidates from the running guest.
"""

from __future__ import annotations

import re

from qmpprof.elf.image import ElfImage

# arm64 links each part of the Image at a SEGMENT_ALIGN (64 KiB) boundary and keeps them so at
# any slide (KASLR moves the whole image by a multiple of it); checked on Debian's 6.1 and 6.12.
ALIGN = 0x10000
_BANNER = re.compile(rb"Linux version \d[^\n\0]{8,400}\n")


def banner(image: ElfImage) -> tuple[int, bytes] | None:
    """(link address, bytes) of the image's ``linux_banner``, None when its .rodata has none."""
    data, addr = image.section(".rodata"), image.section_addr(".rodata")
    if data is None or addr is None:
        return None
    found = _BANNER.search(data)
    return None if found is None else (addr + found.start(), found[0])


def candidates(pc: int, span: tuple[int, int], align: int = ALIGN) -> list[int]:
    """Every slide, a multiple of ``align``, that puts ``pc`` inside ``span`` (the image's link
    range), smallest first; slides are taken modulo 2**64 (one below the link address wraps)."""
    lo, hi = span
    first = -((hi - pc - 1) // align) * align  # the smallest multiple above pc - hi
    last = ((pc - lo) // align) * align
    return [s % (1 << 64) for s in range(first, last + 1, align)]
