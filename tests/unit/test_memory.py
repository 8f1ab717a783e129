"""``StackReader.complete`` (memory.py): the pages an unwind asks for, fetched on demand, and
through a task's page tables with the pages above them in the same request."""

from __future__ import annotations

from collections.abc import Sequence

from fakes import FakeTransport, regs

from qmpprof.memory import MAX_REFETCH, THROUGH_AHEAD, StackReader
from qmpprof.pagecache import PAGE, PageCache

STACK = 0xFFFF_D000_0000  # a user stack page (arm64)


async def test_a_page_fetched_through_page_tables_brings_the_pages_above_it() -> None:
    """A walk up a user stack under a kernel-mode sample lacks one page after another: the
    pages above the first one it lacks come in the same request, and what is beyond the stack's
    top is unmapped (None), not fetched again."""
    mapped = {STACK + i * PAGE: bytes([i]) * PAGE for i in range(2)}
    requests: list[list[int]] = []

    async def through(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        requests.append([addr for addr, _ in ranges])
        return [mapped.get(addr) for addr, _ in ranges]

    cache = PageCache()

    def walk() -> list[bytes | None]:  # reads a word from each page up to the top
        return [cache.read(STACK + i * PAGE + 8, 8) for i in range(3)]

    stacks = StackReader(transport=None)  # type: ignore[arg-type]  # never read directly
    found = await stacks.complete(0, cache, walk, through)
    assert found == [bytes([0]) * 8, bytes([1]) * 8, None]
    assert requests == [[STACK + i * PAGE for i in range(1 + THROUGH_AHEAD)]]


async def test_pages_past_the_refetch_budget_count_as_unmapped() -> None:
    async def through(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        return [b"\0" * PAGE for _ in ranges]

    cache = PageCache()
    far = (1 + THROUGH_AHEAD) * PAGE  # each request brings this much: a walk that skips it

    def walk() -> list[bytes | None]:
        return [cache.read(STACK + i * far, 8) for i in range(MAX_REFETCH + 2)]

    found = await StackReader(transport=None).complete(0, cache, walk, through)  # type: ignore[arg-type]
    assert found.count(None) == 2


async def test_an_sp_above_what_earlier_walks_read_in_its_page_still_gets_a_window() -> None:
    # On riscv64 a walk from SP page+0x100 read nothing past SP+8; the next sample's SP, in the
    # same page, was 0xe00 higher: its window ended 1,664 bytes below its start, and QEMU 7.2's
    # memsave, sent that negative size, died (qmpprof --transport qmp on the riscv64 guest).
    page = STACK
    memory = {page + i * PAGE: bytes(PAGE) for i in range(4)}
    transport = FakeTransport({0: regs(0, 0x40_1000, page + 0x100)}, memory)
    stacks = StackReader(transport)
    low = regs(0, 0x40_1000, page + 0x100)
    first = PageCache()
    await stacks.prefetch(low, first)
    stacks.learn(low, PageCache())  # a walk that read nothing: the deepest byte is SP + 8
    transport.calls.clear()
    high = regs(0, 0x40_1000, page + 0xF00)
    cache = PageCache()
    await stacks.prefetch(high, cache)
    sizes = [int(call.split("+")[1], 16) for call in transport.calls if call.startswith("read:")]
    assert sizes and all(size > 0 for size in sizes), transport.calls
    assert cache.read(page + 0xF00, 8) == bytes(8)  # the window holds SP
