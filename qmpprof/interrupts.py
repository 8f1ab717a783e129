"""SIGINT and SIGTERM while a command runs: the first asks for an orderly stop, another one
cancels the task that installed the handlers (should QEMU stop answering)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Interrupts:
    def __init__(self, stop: Callable[[], None]) -> None:
        self.stop = stop
        self.task = asyncio.current_task()
        self.count = 0

    def __call__(self) -> None:
        self.count += 1
        if self.count == 1:
            self.stop()
        elif self.task is not None:
            self.task.cancel()


@contextmanager
def interrupts(stop: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM call ``stop`` once, then cancel the current task."""
    loop = asyncio.get_running_loop()
    handler = _Interrupts(stop)
    for signum in SIGNALS:
        loop.add_signal_handler(signum, handler)
    try:
        yield
    finally:
        for signum in SIGNALS:
            loop.remove_signal_handler(signum)
