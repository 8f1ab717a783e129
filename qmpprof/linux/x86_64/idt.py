"""The running kernel's KASLR slide, found from what QEMU shows, with no help from the guest.

x86_64 KASLR moves the kernel image by one slide ``S``, a multiple of CONFIG_PHYSICAL_ALIGN
(2 MiB on Debian), chosen so that ``_text`` stays in the 1 GiB kernel-text map
[0xffffffff80000000, 0xffffffffc0000000). Every address of the image moves by ``S``; module
addresses (0xffffffffc0000000 up) and the 0-based per-CPU symbols do not.

The interrupt descriptor table gives the slide away: ``info registers`` prints its base
(``IDT=``, the fixed CPU-entry-area mapping 0xfffffe0000000000 on 6.x, readable with or
without page-table isolation), and its 16-byte gates hold the handlers' runtime addresses:
``asm_exc_divide_error``, ``asm_exc_page_fault``, ``irq_entries_start``, ``asm_sysvec_*``, all
in the image's entry text (``__entry_text_start`` .. ``__entry_text_end``, with the irqentry
text inside). Each present gate's handler ``h`` votes for every slide ``h - a`` where ``a`` is
a text symbol of the entry text with the same remainder modulo the alignment and the slide lies
in the window; the slide most handlers agree on wins, but only when more than half of the
handlers that voted at all, and at least three times as many as for any other slide, chose it.

Why only entry-text symbols: the handlers are 16-byte aligned and packed in 6 KiB, and so are
the kernel's many small functions with their 16-byte ``__pfx_`` paddings; against every text
symbol, wrong slides drew more votes (53 of 156 handlers on Debian's 6.12) than the right one
(41: every named handler). The entry text is smaller than the alignment, so a wrong slide puts
no handler in it. Handlers with no symbol of their own (the IRQ stubs after
``irq_entries_start``; vectors 22-31, left pointing into the freed ``early_idt_handler_array``)
do not vote.

Everything here is pure (bytes and symbols in): ``qmpprof.linux.running.slide`` reads the IDT of
the running guest and hands it over.
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qmpprof.errors import KernelMismatchError
from qmpprof.linux.symbols import TEXT_TYPES, KernelSymbols

ENTRY_TEXT = ("__entry_text_start", "__entry_text_end")
ALIGN = 0x200000  # CONFIG_PHYSICAL_ALIGN of x86_64 distribution kernels
TEXT_MAP = (0xFFFFFFFF80000000, 0xFFFFFFFFC0000000)  # where _text may land (KERNEL_IMAGE_SIZE)
MIN_VOTES = 4
GATE = struct.Struct("<HHBBHII")  # offset 15..0, selector, IST, type/attributes, 31..16, 63..32
_INTERRUPT_GATE, _TRAP_GATE = 0xE, 0xF


@dataclass(frozen=True, slots=True)
class Gate:
    """One 64-bit IDT gate."""

    vector: int
    handler: int
    selector: int
    ist: int
    kind: int  # 0xE interrupt gate, 0xF trap gate
    dpl: int
    present: bool


@dataclass(frozen=True, slots=True)
class SlideVote:
    """The outcome of the vote: the winning slide and how clear the win is."""

    slide: int
    votes: int  # handlers that voted for it
    voters: int  # handlers that voted for any slide
    runner_up: int  # votes for the next slide (0 when none)

    @property
    def clear(self) -> bool:
        return (
            self.votes >= MIN_VOTES
            and 2 * self.votes > self.voters
            and self.votes >= 3 * self.runner_up
        )


def decode_idt(data: bytes) -> list[Gate]:
    """The gates in ``data`` (16 bytes each, the 64-bit layout)."""
    gates = []
    for vector in range(len(data) // GATE.size):
        low, selector, ist, attributes, middle, high, _ = GATE.unpack_from(data, 16 * vector)
        gates.append(
            Gate(
                vector=vector,
                handler=low | middle << 16 | high << 32,
                selector=selector,
                ist=ist & 7,
                kind=attributes & 0xF,
                dpl=attributes >> 5 & 3,
                present=bool(attributes & 0x80),
            )
        )
    return gates


def handlers(gates: Iterable[Gate], kernel_from: int) -> list[int]:
    """The distinct kernel-space handlers (at or above ``kernel_from``) of the present 64-bit
    interrupt and trap gates."""
    found = {
        g.handler
        for g in gates
        if g.present and g.kind in (_INTERRUPT_GATE, _TRAP_GATE) and g.handler >= kernel_from
    }
    return sorted(found)


def vote_slide(
    handler_addrs: Iterable[int],
    symbol_addrs: Sequence[int],
    window: tuple[int, int],
    align: int = ALIGN,
) -> SlideVote | None:
    """Each handler votes once for every slide in ``window`` (low inclusive, high exclusive)
    that puts it exactly on one of ``symbol_addrs`` (the image's); None when nobody voted."""
    by_remainder: defaultdict[int, list[int]] = defaultdict(list)
    for addr in set(symbol_addrs):
        by_remainder[addr % align].append(addr)
    low, high = window
    counts: Counter[int] = Counter()
    voters = 0
    for handler in set(handler_addrs):
        slides = {
            handler - addr
            for addr in by_remainder.get(handler % align, ())
            if low <= handler - addr < high
        }
        voters += bool(slides)
        counts.update(slides)
    if not counts:
        return None
    ranked = counts.most_common(2)
    runner_up = ranked[1][1] if len(ranked) > 1 else 0
    return SlideVote(ranked[0][0], ranked[0][1], voters, runner_up)


def slide_window(image_text: int, align: int = ALIGN) -> tuple[int, int]:
    """The slides that keep ``_text`` (``image_text``) inside the kernel-text map."""
    low = TEXT_MAP[0] - image_text
    return low + (-low % align), TEXT_MAP[1] - image_text


def entry_text_symbols(symbols: KernelSymbols) -> list[int]:
    """The addresses of the image's text symbols in its entry text, where IDT handlers are."""
    start, end = (symbols.address_of(name) for name in ENTRY_TEXT)
    if start is None or end is None:
        raise KernelMismatchError("the image's symbols have no __entry_text_start/_end")
    # The symbols are sorted by address: only the entry text's slice is read, not all 10^5.
    low, high = bisect_left(symbols.addrs, start), bisect_left(symbols.addrs, end)
    return [
        symbols.addrs[i]
        for i in range(low, high)
        if symbols.types[i] in TEXT_TYPES and symbols.modules[i] is None
    ]


def slide_from_gates(
    gates: Iterable[Gate], symbols: KernelSymbols, kernel_from: int, align: int = ALIGN
) -> int:
    """The slide that maps the image ``symbols`` onto the running handlers in ``gates`` (those
    at or above ``kernel_from``, where kernel space starts)."""
    text = symbols.address_of("_text")
    if text is None:
        raise KernelMismatchError("the image's symbols have no _text")
    entry = entry_text_symbols(symbols)
    running = handlers(gates, kernel_from)
    if not running:
        raise KernelMismatchError("no present interrupt gate in the IDT (kernel not booted?)")
    vote = vote_slide(running, entry, slide_window(text, align), align)
    if vote is None:
        raise KernelMismatchError(
            f"none of {len(running)} interrupt handlers is a symbol of the image's entry text"
        )
    if not vote.clear:
        raise KernelMismatchError(
            f"no clear KASLR slide: {vote.slide:#x} has {vote.votes} of {vote.voters} handlers,"
            f" the next {vote.runner_up}"
        )
    return vote.slide


def apply_slide(symbols: KernelSymbols, slide: int) -> KernelSymbols:
    """The image's ``symbols`` where the running kernel has them: every address in the
    kernel-text map or above moves by ``slide``; the 0-based per-CPU symbols stay (measured:
    the result equals the guest's /proc/kallsyms, module lines aside)."""
    low = TEXT_MAP[0]
    addrs = [addr + slide if addr >= low else addr for addr in symbols.addrs]
    return KernelSymbols(addrs, list(symbols.types), list(symbols.names), list(symbols.modules))
