"""The running kernel's vmcoreinfo held against the image (qmpprof.linux.running.vmcoreinfo):
text as Debian's 6.12 writes it, read through a fake guest, checked against its bzImage."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.vmcoreinfo import check, parse, read_vmcoreinfo

SLIDE = 0x2A0_0000
POINTER = 0xFFFF_8880_0123_4000  # where the kernel keeps the text (a page of its own)


@pytest.fixture(scope="module")
def kernel(linux_dir: Path) -> LinuxKernel:
    return LinuxKernel.load(linux_dir / "vmlinuz")


def text_of(kernel: LinuxKernel, release: str, offset: int, moved: int = 0) -> str:
    """vmcoreinfo as the kernel writes it (crash_core.c), ``moved`` added to one symbol."""
    uts = kernel.symbols.address_of("init_uts_ns")
    swapper = kernel.symbols.address_of("init_top_pgt")
    assert uts is not None and swapper is not None
    return (
        f"OSRELEASE={release}\nBUILD-ID=00\nPAGESIZE=4096\n"
        f"SYMBOL(init_uts_ns)={uts + SLIDE + moved:x}\nSYMBOL(init_top_pgt)={swapper + SLIDE:x}\n"
        f"SYMBOL(nonexistent_here)=ffffffff81000000\nOFFSET(list_head.next)=0\n"
        f"SYMBOL(init_task)=ffff888001234000\n"  # a pointer's value (as mem_section's is)
        f"KERNELOFFSET={offset:x}\n"
    )


def test_a_guest_running_its_image_checks_out(kernel: LinuxKernel, linux_dir: Path) -> None:
    release = (linux_dir / "version").read_text().strip()
    found = check(parse(text_of(kernel, release, SLIDE)), kernel, SLIDE)
    assert found.confirmed == 2 and found.notes == ()


def test_another_kernel_another_slide_or_moved_symbols_are_said(kernel: LinuxKernel) -> None:
    notes = check(parse(text_of(kernel, "7.2.13+deb14-amd64", 0x1000, 0x40)), kernel, SLIDE).notes
    assert notes[0].startswith("the guest runs Linux 7.2.13+deb14-amd64, the image is 6.12.")
    assert notes[1] == f"the guest's KERNELOFFSET is 1000, the slide found {SLIDE:#x}"
    assert notes[2].startswith("1 of the guest's 2 vmcoreinfo symbols are elsewhere")


async def test_it_is_read_through_its_pointer_and_size(kernel: LinuxKernel) -> None:
    text = text_of(kernel, "x", SLIDE).encode()
    data = kernel.address("vmcoreinfo_data", SLIDE)
    size = kernel.address("vmcoreinfo_size", SLIDE)
    assert data is not None and size is not None
    memory = {data: POINTER.to_bytes(8, "little"), size: len(text).to_bytes(8, "little")}
    memory[POINTER] = text

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        return [memory.get(addr, b"")[:n] or None for addr, n in ranges]

    found = await read_vmcoreinfo(read, kernel, SLIDE)
    assert found is not None and found["KERNELOFFSET"] == f"{SLIDE:x}"
    memory.pop(POINTER)
    assert await read_vmcoreinfo(read, kernel, SLIDE) is None
