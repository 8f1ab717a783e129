"""``StackReader.complete`` (memory.py): the pages an unwind asks for, fetched on demand, and
through a task's page tables with the pages above them in the same request."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fakes import FakeTransport, regs

from qmpprof.memory import MAX_REFETCH, THROUGH_AHEAD, StackReader
from qmpprof.pagecache import PAGE, PageCache

STACK = 0xFFFF_D000_0000  # a user stack page (arm64)
# A kernel-mode sample (its kernel stack's page is the key of what walks from it learn).
IN_KERNEL = regs(0, 0xFFFF_FFFF_8100_0000, 0xFFFF_C900_0000_4F00)


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
    found = await stacks.complete(IN_KERNEL, cache, walk, through)
    assert found == [bytes([0]) * 8, bytes([1]) * 8, None]
    assert requests == [[STACK + i * PAGE for i in range(1 + THROUGH_AHEAD)]]


async def test_the_pages_ahead_are_as_many_as_the_last_walk_from_that_stack_used() -> None:
    """A walk that used only the page it lacked: the next one from the same kernel stack asks
    for that page alone; one from another stack still gets THROUGH_AHEAD more; a walk that
    needs the next page again asks for it (and the one after it learns so)."""
    mapped = {STACK + i * PAGE: bytes([i]) * PAGE for i in range(4)}
    requests: list[list[int]] = []

    async def through(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        requests.append([addr for addr, _ in ranges])
        return [mapped.get(addr) for addr, _ in ranges]

    def walk_over(cache: PageCache, pages: int) -> Callable[[], list[bytes | None]]:
        return lambda: [cache.read(STACK + i * PAGE + 8, 8) for i in range(pages)]

    stacks = StackReader(transport=None)  # type: ignore[arg-type]  # never read directly
    for pages in (1, 1, 2, 2):
        cache = PageCache()
        await stacks.complete(IN_KERNEL, cache, walk_over(cache, pages), through)
    other = regs(0, IN_KERNEL.pc, IN_KERNEL.sp + 4 * PAGE)
    cache = PageCache()
    await stacks.complete(other, cache, walk_over(cache, 1), through)
    first, after_one, needs_two, after_two, elsewhere = requests[0], *requests[1:3], *requests[4:]
    assert first == [STACK + i * PAGE for i in range(1 + THROUGH_AHEAD)]
    assert after_one == [STACK] and needs_two == [STACK]  # then the next page alone
    assert requests[3] == [STACK + PAGE]
    assert after_two == [STACK, STACK + PAGE]
    assert elsewhere == first


async def test_pages_past_the_refetch_budget_count_as_unmapped() -> None:
    async def through(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        return [b"\0" * PAGE for _ in ranges]

    cache = PageCache()
    far = (1 + THROUGH_AHEAD) * PAGE  # each request brings this much: a walk that skips it

    def walk() -> list[bytes | None]:
        return [cache.read(STACK + i * far, 8) for i in range(MAX_REFETCH + 2)]

    found = await StackReader(transport=None).complete(IN_KERNEL, cache, walk, through)  # type: ignore[arg-type]
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
