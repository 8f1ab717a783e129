"""``StackReader`` (memory.py): the pages an unwind asks for, fetched on demand, and through a
task's page tables with the pages above them in the same request; what a walk read through
page tables fetched with the next window from its stack; what one stack's walks teach kept
apart from another's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fakes import FakeTransport, regs, x86

from qmpprof.errors import MemoryReadError
from qmpprof.memory import MAX_REFETCH, MAX_THROUGH, THROUGH_AHEAD, StackReader, held, reader
from qmpprof.model import Registers
from qmpprof.pagecache import PAGE, PageCache, page_of

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


DIRECT = 0xFFFF_8880_0123_4000  # a page of the kernel's linear map (a user stack's, say)
ENTRY = 0xFFFF_8880_0200_0FF8  # a page-table entry there


class Requests(FakeTransport):
    """A FakeTransport that counts requests (``read_many`` calls) and what each asked."""

    def __init__(self, regs_by_cpu: dict[int, Registers], pages: dict[int, bytes]) -> None:
        super().__init__(regs_by_cpu, pages)
        self.requests: list[list[tuple[int, int]]] = []

    async def read_many(
        self, cpu: int, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes | MemoryReadError]:
        self.requests.append(list(ranges))
        return await super().read_many(cpu, ranges)


def kernel_memory() -> dict[int, bytes]:
    stack = page_of(IN_KERNEL.sp)
    return {
        stack: bytes(PAGE),
        DIRECT: bytes([7]) * PAGE,
        page_of(ENTRY): bytes([9]) * PAGE,
    }


async def test_what_a_walk_read_through_page_tables_comes_with_the_next_window() -> None:
    """riscv64 and arm64 read a task's user stack under a kernel-mode sample through its page
    tables (the vCPU shows no user page there): the entries and the linear map's page the last
    walk from a kernel stack read come with the next window from it, in its request, and a
    reader over the sample's cache answers them without another; a user-mode sample, or a walk
    that read more than MAX_THROUGH, fetches none."""
    transport = Requests({}, kernel_memory())
    stacks = StackReader(transport)
    through = [(ENTRY, 8), (DIRECT, PAGE)]
    stacks.learn(IN_KERNEL, PageCache(), 0xFFFF_8000_0000_0000, through)
    seen = PageCache()
    await stacks.prefetch(IN_KERNEL, PageCache(), (), seen)
    assert len(transport.requests) == 1 and transport.requests[0][1:] == through
    seen.asked = []
    read = held(reader(transport, 0), seen)
    assert await read(through) == [bytes([9]) * 8, bytes([7]) * PAGE]
    assert len(transport.requests) == 1 and seen.asked == through
    assert await read([(DIRECT - PAGE, 8)]) == [None]  # what it lacks: read, in a request
    assert transport.requests[1:] == [[(DIRECT - PAGE, 8)]]

    # The exception entry's first instructions, still on the user's sp: what they read
    # through page tables is not fetched by user code at that sp.
    entering = x86(0, IN_KERNEL.pc, STACK + 0x100, cpl=0, cr3=0)
    user = x86(0, 0x40_1000, STACK + 0x100, cpl=3, cr3=0)
    stacks.learn(entering, PageCache(), 0xFFFF_8000_0000_0000, through)
    stacks.learn(IN_KERNEL, PageCache(), 0, [(DIRECT + i * PAGE, PAGE) for i in range(4)])
    assert 4 * PAGE > MAX_THROUGH
    transport.requests.clear()
    for sample in (user, IN_KERNEL):
        await stacks.prefetch(sample, PageCache(), (), PageCache())
    assert [len(request) for request in transport.requests] == [1, 1]  # the windows alone


async def test_user_memory_a_kernel_walk_read_otherwise_is_not_fetched_with_its_window() -> None:
    """What a kernel-mode walk read below ``floor`` (the user stack, read through the task's
    tables) is no piece for the next window, which reads as the vCPU sees; what it read above
    (another kernel stack, say) is."""
    memory = {**kernel_memory(), STACK: bytes(PAGE)}
    for floor, fetched in ((0, [STACK]), (0xFFFF_8000_0000_0000, [])):
        transport = Requests({}, memory)
        stacks = StackReader(transport)
        walked = PageCache()
        walked.pages[STACK] = bytes(PAGE)
        walked.read(STACK + 0x80, 8)  # the walk's read of the user stack
        stacks.learn(IN_KERNEL, walked, floor)
        await stacks.prefetch(IN_KERNEL, PageCache())
        (request,) = transport.requests
        assert [page_of(a) for a, _ in request[1:]] == fetched


async def test_a_vcpu_that_translates_nothing_teaches_the_user_stack_s_window_nothing() -> None:
    """riscv64's firmware (M-mode) entered from user code holds the user's sp, which it reads
    physically: unmapped there. The user stack's next window at that page is not cut to
    nothing by it (the page reads as the user's, whose space register says 0 as the
    firmware's)."""
    page = STACK
    transport = Requests({}, {page: bytes(PAGE)})
    stacks = StackReader(transport)
    firmware = x86(1, 0xF_0000, page + 0x200, cpl=0, cr3=0, cr0=0x11)  # PE set, PG clear
    user = x86(0, 0x40_1000, page + 0x100, cpl=3, cr3=0)
    assert firmware.special["paging"] == 0 and firmware.space == user.space == 0
    cache = PageCache()
    cache.pages[page] = None  # what the firmware's window found
    stacks.learn(firmware, cache)
    transport.requests.clear()
    window = PageCache()
    await stacks.prefetch(user, window)
    assert window.read(page + 0x100, 8) == bytes(8)


async def test_the_page_a_walk_lacked_first_is_read_before_the_next_walk_from_there_asks() -> None:
    """A kernel-mode walk lacks the user stack's page and is run again once it is read: the
    next walk from the same kernel stack has that page read before it starts (one walk, not
    two); one from another kernel stack does not."""
    mapped = {STACK: bytes([1]) * PAGE}
    requests: list[list[int]] = []

    async def through(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        requests.append([addr for addr, _ in ranges])
        return [mapped.get(addr) for addr, _ in ranges]

    stacks = StackReader(transport=None)  # type: ignore[arg-type]  # never read directly
    walks: list[int] = []
    for sample in (IN_KERNEL, IN_KERNEL, regs(0, IN_KERNEL.pc, IN_KERNEL.sp + 4 * PAGE)):
        cache = PageCache()
        tries = [0]

        def walk(cache: PageCache = cache, tries: list[int] = tries) -> bytes | None:
            tries[0] += 1
            return cache.read(STACK + 8, 8)

        assert await stacks.complete(sample, cache, walk, through) == bytes([1]) * 8
        walks.append(tries[0])
    assert walks == [2, 1, 2]
    assert requests[1] == [STACK]  # ahead as many pages as the last walk used: none
