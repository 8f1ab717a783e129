"""Where a kernel keeps ``task_state_array`` (the state names /proc shows), found by its content
when kallsyms names no data symbol (bookworm's arm64 6.1).

fs/proc/array.c's ``static const char * const task_state_array[]`` is read-only data: pointers
to "R (running)", "S (sleeping)", ... (4.14 to 7.2). In the image's ``.rodata`` (its relocations
applied) the array is the place where a pointer to a "R (running)" string is followed by one to
a "S (sleeping)" string.
"""

from __future__ import annotations

import re

from qmpprof.elf.image import ElfImage

_RUNNING = re.compile(rb"(?<=\0)R \(running\)\0")
_SLEEPING = b"S (sleeping)\0"


def task_state_array(image: ElfImage) -> int | None:
    """The array's link address, None when no such array is in ``.rodata``."""
    data, base = image.section(".rodata"), image.section_addr(".rodata")
    return None if data is None or base is None else state_array_in(data, base)


def state_array_in(data: bytes, base: int) -> int | None:
    """The array in ``data`` (read-only data at ``base``, relocated), None when not there."""
    for text in _RUNNING.finditer(data):
        pointer = (base + text.start()).to_bytes(8, "little")
        at = data.find(pointer)
        while at >= 0:
            if at % 8 == 0:
                second = int.from_bytes(data[at + 8 : at + 16], "little") - base
                if second >= 0 and data[second : second + len(_SLEEPING)] == _SLEEPING:
                    return base + at
            at = data.find(pointer, at + 1)
    return None
