"""KASLR slide detection end to end on the Linux test guest: the slide is 0 under nokaslr and,
on several KASLR boots, (guest /proc/kallsyms _text) - (image _text); on every kernel booted,
the slide and the image's kallsyms, ORC and BTF at that slide against the running kernel's."""

from __future__ import annotations

import struct
from functools import cache
from pathlib import Path

import linuxkernel
import pytest
from linuxvm import LinuxGuest, running_linux_guest
from sharedlinux import Shared

from qmpprof.arch.x86 import X86_64
from qmpprof.linux.kallsyms import locate_kallsyms, read_kallsyms
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.linux.x86_64 import idt as kaslr
from qmpprof.linux.x86_64.running import idt_slide
from qmpprof.transport.qmp import QmpTransport

# ---- end to end, on the Linux test guest ----------------------------------------------------


@cache
def image_symbols_of(series: str) -> KernelSymbols:
    return read_kallsyms(linuxkernel.vmlinux(series))


async def slide_of(guest: LinuxGuest, series: str = "6.12") -> int:
    transport = await QmpTransport.connect(guest.qmp_socket)
    try:
        return await idt_slide(transport, image_symbols_of(series), X86_64)
    finally:
        await transport.close()


def true_slide(guest: LinuxGuest, series: str = "6.12") -> int:
    """The guest's _text (printed by init from /proc/kallsyms) minus the image's."""
    image = image_symbols_of(series).address_of("_text")
    assert image is not None
    return guest.text_address - image


@pytest.mark.linux
async def test_slide_is_zero_without_kaslr(nokaslr_linux: Shared) -> None:
    guest = nokaslr_linux.guest
    assert await slide_of(guest) == 0 == true_slide(guest)


@pytest.mark.qemu
@pytest.mark.linux
async def test_slide_on_several_kaslr_boots(tmp_path: Path) -> None:
    slides = []
    for _ in range(3):
        with running_linux_guest(tmp_path, kaslr=True, dump_kallsyms=False) as guest:
            slide = await slide_of(guest)
            assert slide == true_slide(guest)
            assert slide % kaslr.ALIGN == 0
        slides.append(slide)
    assert len(set(slides)) >= 2, f"three boots, slides {[hex(s) for s in slides]}"


@pytest.mark.linux
async def test_the_images_tables_are_the_running_kernels(kaslr_linux: Shared) -> None:
    """On every kernel booted with KASLR: the slide found over the IDT is the true one, and
    what qmpprof reads from the image serves the running kernel at that slide: its kallsyms
    (every symbol) and its ORC and BTF (byte for byte)."""
    guest, series = kaslr_linux.guest, kaslr_linux.series
    slide = await slide_of(guest, series)
    assert slide == true_slide(guest, series) != 0
    assert slide % kaslr.ALIGN == 0
    await check_kallsyms_under_slide(guest, series, slide)
    await check_orc_under_slide(guest, series, slide)


async def check_kallsyms_under_slide(guest: LinuxGuest, series: str, slide: int) -> None:
    """The image's symbols moved by the slide (zero-based per-CPU ones stay) are exactly the
    guest's /proc/kallsyms kernel lines. In memory the kernel relocated
    kallsyms_relative_base by the slide (where the kernel has one: the tables read from guest
    memory give runtime addresses), never the offsets (on 7.x relative to their own address)."""
    running = guest.symbols
    kernel = [
        (addr, name)
        for addr, name, module in zip(running.addrs, running.names, running.modules, strict=True)
        if module is None
    ]
    moved = kaslr.apply_slide(image_symbols_of(series), slide)
    assert sorted(zip(moved.addrs, moved.names, strict=True)) == sorted(kernel)
    vmlinux = linuxkernel.vmlinux(series)
    rodata, rodata_addr = vmlinux.section(".rodata"), vmlinux.section_addr(".rodata")
    assert rodata is not None and rodata_addr is not None
    layout = locate_kallsyms(rodata, rodata_addr)
    transport = await QmpTransport.connect(guest.qmp_socket)
    try:
        offsets = await transport.read(0, rodata_addr + slide + layout.offsets, 4096)
        if layout.relative_base is not None:
            (file_base,) = struct.unpack_from("<Q", rodata, layout.relative_base)
            memory = await transport.read(0, rodata_addr + slide + layout.relative_base, 8)
            assert struct.unpack("<Q", memory)[0] == file_base + slide
    finally:
        await transport.close()
    assert offsets == rodata[layout.offsets : layout.offsets + 4096]


async def check_orc_under_slide(guest: LinuxGuest, series: str, slide: int) -> None:
    """The ORC tables (and BTF) in guest memory at image address + slide are the file's bytes:
    the image's tables serve the running kernel, looked up at pc - slide."""
    vmlinux = linuxkernel.vmlinux(series)
    transport = await QmpTransport.connect(guest.qmp_socket)
    try:
        for name in (".orc_unwind_ip", ".orc_unwind", ".BTF"):
            data, addr = vmlinux.section(name), vmlinux.section_addr(name)
            assert data is not None and addr is not None
            for offset in range(0, len(data), 1 << 20):
                size = min(1 << 20, len(data) - offset)
                memory = await transport.read(0, addr + slide + offset, size)
                assert memory == data[offset : offset + size], f"{name}+{offset:#x}"
    finally:
        await transport.close()
