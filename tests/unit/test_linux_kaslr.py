"""KASLR slide detection from IDT bytes built by hand: gate decoding, the vote, its refusals,
and idt_slide over a fake guest (on the Linux test guest: tests/e2e/test_linux_kaslr_slide.py)."""

from __future__ import annotations

import struct

import pytest
from fakes import FakeTransport, x86

from qmpprof.arch.x86 import X86_64
from qmpprof.errors import KernelMismatchError
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.linux.x86_64 import idt as kaslr
from qmpprof.linux.x86_64.running import idt_slide

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


def test_entry_text_symbols_are_the_image_text_symbols_from_start_to_end() -> None:
    """Text symbols of the image in [__entry_text_start, __entry_text_end): not data, not a
    module's, not the end symbol's address or anything past it."""
    rows = [
        (0x1000, "T", "before", None),
        (0x2000, "T", "__entry_text_start", None),
        (0x2000, "T", "asm_exc_divide_error", None),
        (0x2040, "d", "entry_data", None),
        (0x2080, "t", "asm_sysvec_apic_timer_interrupt", "[mod]"),
        (0x20C0, "t", "entry_SYSCALL_64", None),
        (0x3000, "T", "__entry_text_end", None),
        (0x3000, "T", "after", None),
    ]
    addrs, types, names, modules = (list(column) for column in zip(*rows, strict=True))
    symbols = KernelSymbols(addrs, types, names, modules)
    assert kaslr.entry_text_symbols(symbols) == [0x2000, 0x2000, 0x20C0]
