"""Every task of a guest at one moment, on a CPU or waiting, with the stacks of those waiting.

One pause (none when the guest was paused already: it stays so): the guest OS lists its tasks
(``TaskLister``) and, for each task off CPU, where its kernel stack resumes and the user
registers it entered the kernel with; the stacks are walked while the guest stands still
(each task's memory as the guest OS reads it: user pages through the task's own page
tables); frames
are named after the guest runs again. A task's stack is its kernel frames (the walk from its
saved context, cut where it crosses into user mode) then its user frames (the walk from its
saved user registers).
"""

from __future__ import annotations

import dataclasses

from qmpprof.guest.base import FoundTask, TaskLister
from qmpprof.model import Registers, Stack, StopReason, TaskView
from qmpprof.pagecache import PAGE, PageCache, PageMissing, page_of
from qmpprof.sampler import StackUnwinder
from qmpprof.transport.base import GuestTransport
from qmpprof.unwind.chain import RawStack
from qmpprof.unwind.space import AddressSpace

MAX_PAGES = 64  # pages fetched for one task's walks, at most


@dataclasses.dataclass(frozen=True, slots=True)
class _Walked:
    found: FoundTask
    kernel: RawStack | None
    user: RawStack | None


async def every_task(
    transport: GuestTransport,
    lister: TaskLister,
    unwinder: StackUnwinder[AddressSpace, RawStack],
    boundary: int,
) -> list[TaskView]:
    """Every task of the guest in one pause; the guest is left in the run state it had.
    ``boundary``: where kernel addresses begin."""
    was_running = await transport.is_running()
    if was_running:
        await transport.stop()
    try:
        found = await lister.every_task(transport)
        walked = [await _walk(task, unwinder) for task in found]
    finally:
        if was_running:
            await transport.cont()
    return [_view(w, unwinder, boundary) for w in walked]


async def _walk(task: FoundTask, unwinder: StackUnwinder[AddressSpace, RawStack]) -> _Walked:
    cache = PageCache()
    if task.window is not None:
        cache.put_window(*task.window)
    budget = [MAX_PAGES]

    async def walk(regs: Registers | None) -> RawStack | None:
        if regs is None:
            return None
        while True:
            try:
                return unwinder.unwind(regs, cache, task.space)
            except PageMissing as missing:
                page = page_of(missing.addr)
                budget[0] -= 1
                if task.read is None or budget[0] < 0:
                    cache.pages[page] = None
                    continue
                (cache.pages[page],) = await task.read([(page, PAGE)])

    return _Walked(task, await walk(task.kernel), await walk(task.user))


def _view(
    walked: _Walked, unwinder: StackUnwinder[AddressSpace, RawStack], boundary: int
) -> TaskView:
    """After the guest runs again: the frames named."""
    found = walked.found
    stack = None
    if walked.kernel is not None:
        kernel = _kernel_part(walked.kernel, boundary)
        frames = unwinder.resolve(kernel, found.space).frames
        stop = kernel.stop
        if walked.user is not None:
            user = unwinder.resolve(walked.user, found.space)
            frames, stop = frames + user.frames, user.stop
        stack = Stack(frames, stop)
    return TaskView(found.process, found.state, found.state_name, found.cpu, stack)


def _kernel_part(raw: RawStack, boundary: int) -> RawStack:
    """The kernel frames of a walk that went on into user mode (the user frames come from the
    saved user registers instead)."""
    n = next((i for i, pc in enumerate(raw.pcs) if pc < boundary), len(raw.pcs))
    if n == len(raw.pcs):
        return raw
    return RawStack(raw.pcs[:n], StopReason.END, raw.exact[:n], raw.via[:n])
