"""KASLR slide detection from IDT bytes built by hand: gate decoding, the vote, its refusals,
and idt_slide over a fake guest; then end to end on the Linux test guest: the slide
is 0 under nokaslr and, on several KASLR boots, (guest /proc/kallsyms _text) - (image _text);
on every kernel booted, the slide and the image's kallsyms, ORC and BTF at that slide against
the running kernel's."""

from __future__ import annotations

import struct
from functools import cache
from pathlib import Path

import linuxkernel
import pytest
from fakes import FakeTransport, x86
from linuxvm import LinuxGuest, running_linux_guest
from sharedlinux import Shared

from qmpprof.arch.x86 import X86_64
from qmpprof.errors import KernelMismatchError
from qmpprof.linux.kallsyms import locate_kallsyms, read_kallsyms
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.linux.x86_64 import idt as kaslr
from qmpprof.linux.x86_64.running import idt_slide
from qmpprof.transport.qmp import QmpTransport

TEXT = 0xFFFFFFFF81000000
ENTRY = 0xFFFFFFFF81E00000
MIB2 = 0x200000
KERNEL = X86_64.shared_from  # where kernel space starts
# Named handlers in the entry text, 32 bytes apart, as idtentry lays them out.
HANDLERS = [ENTRY + 0x1000 + 0x20 * i for i in range(24)]


def gate(
    handler: int, *, present: bool = True, kind: int = 0xE, ist: int = 0, dpl: int = 0
) -> bytes:
    return struct.pack(
        "<HHBBHII",
        handler & 0xFFFF,  # offset 15..0
        0x10,  # kernel code selector
        ist,  # interrupt stack table index (bits 0..2)
        (0x80 if present else 0) | dpl << 5 | kind,  # P, DPL, type
        handler >> 16 & 0xFFFF,  # offset 31..16
        handler >> 32,  # offset 63..32
        0,  # reserved
    )


def image_symbols() -> KernelSymbols:
    rows = [
        (TEXT, "T", "_text"),
        (TEXT + 0x1000, "T", "start_kernel"),
        (ENTRY + 0x10, "T", "__entry_text_start"),
        (ENTRY + 0x230, "T", "irq_entries_start"),
        *((h, "T", f"asm_exc_{i}") for i, h in enumerate(HANDLERS)),
        (ENTRY + 0x2300, "T", "__entry_text_end"),
        # Outside the entry text: a dense run of small functions that must never vote.
        *((TEXT + 0x400000 + 0x1000 + 0x10 * i, "t", f"small_{i}") for i in range(400)),
    ]
    rows.sort()
    return KernelSymbols([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def idt(slide: int, stubs: int = 200) -> bytes:
    """24 named exception handlers, then IRQ stubs 16 bytes apart with no symbol of their own."""
    named = [gate(h + slide) for h in HANDLERS]
    irq = [gate(ENTRY + 0x230 + 0x10 * (i + 1) + slide) for i in range(stubs)]
    return b"".join(named + irq)


def test_decode_gate_fields() -> None:
    data = gate(0xFFFFFFFF81E01030, ist=3, kind=0xE, dpl=3) + gate(0, present=False)
    first, second = kaslr.decode_idt(data)
    assert first == kaslr.Gate(0, 0xFFFFFFFF81E01030, 0x10, 3, 0xE, 3, True)
    assert not second.present and second.vector == 1


@pytest.mark.parametrize("slide", [0, MIB2, 0x2E000000, 0x3EC00000 - 0x1000000])
def test_slide_found(slide: int) -> None:
    assert kaslr.slide_from_gates(kaslr.decode_idt(idt(slide)), image_symbols(), KERNEL) == slide


def test_absent_gates_and_user_handlers_do_not_vote() -> None:
    noise = gate(0xDEAD0000, present=True) + gate(ENTRY + 0x1000 + 4 * MIB2, present=False)
    gates = kaslr.decode_idt(idt(6 * MIB2) + noise)
    assert kaslr.handlers(gates, KERNEL)[0] != 0xDEAD0000
    assert kaslr.slide_from_gates(gates, image_symbols(), KERNEL) == 6 * MIB2


def test_slide_outside_the_text_map_is_not_considered() -> None:
    # Handlers 1 GiB up would put _text past 0xffffffffc0000000: no slide fits.
    with pytest.raises(KernelMismatchError, match="none of 224 interrupt handlers"):
        kaslr.slide_from_gates(kaslr.decode_idt(idt(0x40000000)), image_symbols(), KERNEL)


def test_unaligned_shift_matches_nothing() -> None:
    with pytest.raises(KernelMismatchError, match="is a symbol of the image's entry text"):
        kaslr.slide_from_gates(kaslr.decode_idt(idt(0x1008)), image_symbols(), KERNEL)


def test_split_vote_is_refused() -> None:
    halves = [gate(h + (0 if i % 2 else 2 * MIB2)) for i, h in enumerate(HANDLERS)]
    with pytest.raises(KernelMismatchError, match=r"no clear KASLR slide: .* 12 of 24 handlers"):
        kaslr.slide_from_gates(kaslr.decode_idt(b"".join(halves)), image_symbols(), KERNEL)


def test_too_few_votes_are_refused() -> None:
    data = b"".join(gate(h + MIB2) for h in HANDLERS[: kaslr.MIN_VOTES - 1])
    with pytest.raises(KernelMismatchError, match="no clear KASLR slide"):
        kaslr.slide_from_gates(kaslr.decode_idt(data), image_symbols(), KERNEL)


def test_image_without_entry_text_markers() -> None:
    symbols = KernelSymbols([TEXT], ["T"], ["_text"])
    with pytest.raises(KernelMismatchError, match="__entry_text_start"):
        kaslr.slide_from_gates(kaslr.decode_idt(idt(0)), symbols, KERNEL)


def test_empty_idt() -> None:
    with pytest.raises(KernelMismatchError, match="no present interrupt gate"):
        kaslr.slide_from_gates(
            kaslr.decode_idt(gate(0, present=False) * 4), image_symbols(), KERNEL
        )


def test_vote_counts() -> None:
    vote = kaslr.vote_slide([ENTRY + 0x1000 + MIB2], [ENTRY + 0x1000], (0, 1 << 30))
    assert vote == kaslr.SlideVote(MIB2, 1, 1, 0) and not vote.clear
    assert kaslr.vote_slide([ENTRY + 0x1001], [ENTRY + 0x1000], (0, 1 << 30)) is None


def test_apply_slide_moves_all_but_per_cpu_symbols() -> None:
    symbols = KernelSymbols([0, 0x1000, TEXT, ENTRY], ["A", "A", "T", "T"], ["a", "b", "c", "d"])
    moved = kaslr.apply_slide(symbols, 3 * MIB2)
    assert moved.addrs == [0, 0x1000, TEXT + 3 * MIB2, ENTRY + 3 * MIB2]
    assert moved.names == symbols.names and symbols.addrs[2] == TEXT


def test_slide_window() -> None:
    assert kaslr.slide_window(TEXT) == (-0x1000000, 0x3F000000)


def monitored(idt_base: int, table: bytes) -> FakeTransport:
    """A guest whose vCPU 0 holds an IDT at ``idt_base`` (as the monitor's registers say) and
    whose memory holds ``table`` there."""
    regs = x86(0, 0)
    regs.special.update(idt_base=idt_base, idt_limit=len(table) - 1)
    pages = {
        idt_base + off: table[off : off + 4096].ljust(4096, b"\0")
        for off in range(0, len(table), 4096)
    }
    return FakeTransport({0: regs}, pages)


async def test_the_slide_is_found_with_one_read_of_the_idt() -> None:
    guest = monitored(0xFFFFFE0000000000, idt(0x2E000000, stubs=232))
    assert await idt_slide(guest, image_symbols(), X86_64) == 0x2E000000
    assert [c for c in guest.calls if c.startswith("read")] == ["read:0xfffffe0000000000+0x1000"]


async def test_no_slide_before_the_kernel_runs() -> None:
    with pytest.raises(KernelMismatchError, match="IDT at 0x0 is not in kernel space"):
        await idt_slide(monitored(0, idt(0)), image_symbols(), X86_64)


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


@pytest.mark.qemu
@pytest.mark.linux
async def test_slide_is_zero_without_kaslr(tmp_path: Path) -> None:
    with running_linux_guest(tmp_path, kaslr=False, dump_kallsyms=False) as guest:
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
