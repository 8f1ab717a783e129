"""SIGINT and SIGTERM, from the first line of a command to its last, in three stages.

1. ``installed()`` (the command line's first act): while nothing was opened in QEMU (parsing,
   loading files), a signal raises ``Interrupted`` where the program is; nothing to undo.
2. ``interrupts(on_first)`` (inside the event loop, from before the first byte sent to QEMU
   until the connection is closed): the loop handles the signal between two steps of the run.
   The first calls ``on_first(signum)`` (a run cancels itself to undo what it opened, or stops
   sampling after its tick); another one cancels the task that installed them (QEMU no longer
   answers). A cancellation that leaves the block after a signal becomes ``Interrupted``.
3. Once that block is left under ``installed()``, the command is ending: a signal is ignored,
   so that it cannot cut the last clean-up (closing the loop, stopping serve's HTTP server)
   short. Without ``installed()`` (a test's own loop), the handlers found are restored.

A signal that arrives before Python runs qmpprof's first line (the interpreter's own start)
meets the default actions: nothing was opened yet.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)
Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM ended the command. Exit status 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(name(signum))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def name(signum: int) -> str:
    return signal.Signals(signum).name


# Signals stage 1 raised for. Python drops an exception raised where nobody can catch it (a
# weakref callback, __del__: "Exception ignored in"); stage 2 raises it again on entry.
_early: list[int] = []


def _raise(signum: int, frame: FrameType | None) -> None:
    _early.append(signum)
    raise Interrupted(signum)


def _quiet(hook: Callable[[sys.UnraisableHookArgs], object]) -> Callable[..., object]:
    """``sys.unraisablehook`` that says nothing of a dropped Interrupted (see _early)."""

    def unraisable(info: sys.UnraisableHookArgs) -> object:
        return None if isinstance(info.exc_value, Interrupted) else hook(info)

    return unraisable


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Stage 3: the command is ending by itself."""


def _handlers() -> dict[signal.Signals, Handler]:
    """The handlers in place (SIG_DFL for one installed outside Python)."""
    found = {signum: signal.getsignal(signum) for signum in SIGNALS}
    return {signum: signal.SIG_DFL if h is None else h for signum, h in found.items()}


@contextmanager
def installed(*, restore: bool = True) -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM raise ``Interrupted`` (stage 1); after it, the handlers
    found are restored, or (``restore`` False: the program itself, about to exit) ignored."""
    # Both signals are held while handlers change, so that one arriving meanwhile is met by a
    # whole set (it raises at the first line of the block, or reaches the handlers restored).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    previous, hook = _handlers(), sys.unraisablehook
    _early.clear()
    sys.unraisablehook = _quiet(hook)
    try:
        for signum in SIGNALS:
            signal.signal(signum, _raise)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        for signum, handler in previous.items():
            # SIG_IGN, not _ignore: Python resets its own handlers to the default while it exits.
            signal.signal(signum, handler if restore else signal.SIG_IGN)
        if restore:
            sys.unraisablehook = hook
        _early.clear()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Caught:
    """What the loop's handler saw: the signals, in order; ``first`` calls ``on_first``."""

    def __init__(self, on_first: Callable[[int], None]) -> None:
        import asyncio  # here, not on top: stage 1 begins before anything heavy is imported

        self.on_first = on_first
        self.task = asyncio.current_task()
        self.signals: list[int] = []

    @property
    def signum(self) -> int | None:
        """The first signal caught, if any."""
        return self.signals[0] if self.signals else None

    def __call__(self, signum: int) -> None:
        self.signals.append(signum)
        if len(self.signals) == 1:
            self.on_first(signum)
        elif self.task is not None:
            self.task.cancel()


@contextmanager
def interrupts(on_first: Callable[[int], None]) -> Iterator[Caught]:
    """Within the block, the event loop handles SIGINT/SIGTERM (stage 2): the first calls
    ``on_first(signum)``, others cancel the current task. After it, stage 3. A signal of stage 1
    that Python dropped is raised now, before anything is opened."""
    import asyncio  # as in Caught

    if _early:
        raise Interrupted(_early[0])
    loop = asyncio.get_running_loop()
    caught = Caught(on_first)
    previous = _handlers()
    for signum in SIGNALS:
        loop.add_signal_handler(signum, caught, signum)
    try:
        yield caught
    except asyncio.CancelledError:
        if caught.signum is None:
            raise
        raise Interrupted(caught.signum) from None  # what a signal cancelled
    finally:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            signal.signal(signum, _ignore if handler is _raise else handler)
