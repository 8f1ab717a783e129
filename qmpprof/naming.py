"""How frames become names, in one place: for every writer, the one-shot listing and the
top-stacks summary alike. A profile keeps frames as data; names are made from them only here.

One naming option: ``function`` (the default), ``offset`` (``function+0x1f``) or ``line``
(``function (file:line)``, with the functions inlined at a pc as frames of their own, marked
``_[i]``; without it inlined frames are folded into the function they were inlined in).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.model import FIRMWARE, Frame, Process, StopReason

KERNEL_ROOT = "kernel"
KERNEL_SUFFIX = "_[k]"
INLINED_SUFFIX = "_[i]"
TRUNCATED = "[truncated]"
USER_GONE = "[user space gone]"  # a process whose user address space was released (exiting)
UNKNOWN = "[unknown]"
# The machine's firmware (BIOS, option ROMs): a sample of it is this one name, no context.
FIRMWARE_NAME = FIRMWARE.name


def off_cpu_name(state: str) -> str:
    """The frame that tells a task off CPU in state ``state`` (its letter) from one on it."""
    return f"[off-cpu: {state}]"


class Detail(enum.Enum):
    FUNCTION = "function"
    OFFSET = "offset"
    LINE = "line"


@dataclass(frozen=True, slots=True)
class Naming:
    """How frames are turned into names."""

    detail: Detail = Detail.FUNCTION
    show_addresses: bool = False  # append @0x... to every frame
    mark_kernel: bool = True  # _[k] on kernel frames when the sample belongs to a process

    @classmethod
    def of(
        cls, *, offsets: bool = False, lines: bool = False, show_addresses: bool = False
    ) -> Naming:
        """From the command line's flags (--lines wins over --offsets)."""
        detail = Detail.LINE if lines else Detail.OFFSET if offsets else Detail.FUNCTION
        return cls(detail, show_addresses)


def frame_name(frame: Frame, naming: Naming, mark_kernel: bool) -> str:
    if is_firmware(frame):
        return f"{FIRMWARE_NAME} @{frame.pc:#x}" if naming.show_addresses else FIRMWARE_NAME
    if frame.symbol is None:
        # A program without symbols is still told apart by address; elsewhere an address that
        # no symbol covers is one [unknown] bucket unless addresses are asked for.
        by_address = naming.show_addresses or frame.module_name == UNKNOWN
        name = f"{frame.pc:#x}" if by_address else UNKNOWN
    else:
        name = frame.symbol
        if naming.detail is Detail.OFFSET:
            name = f"{name}+{frame.offset:#x}"
        elif naming.detail is Detail.LINE and frame.file is not None:
            name = f"{name} ({frame.file}:{frame.line})"
        if naming.show_addresses:
            name = f"{name} @{frame.pc:#x}"
    module = frame.module_name
    bracketed = module is not None and module.startswith("[") and module != UNKNOWN
    if bracketed and (frame.kernel or frame.symbol is None):
        # A kernel module's code, function [module]; code with no symbol, [unknown] [mapping].
        name = f"{name} {module}"
    elif frame.symbol is None and not frame.kernel and frame.module and frame.module.path:
        # A file's code no symbol covers (a stripped library's internal function): the file,
        # and with --offsets where in it (its link address, as addr2line takes it).
        where = frame.module.name
        if naming.detail is not Detail.FUNCTION:
            where += f"+{frame.pc - frame.module.bias:#x}"
        name = f"{name} [{where}]"
    if frame.inlined:
        name += INLINED_SUFFIX
    if mark_kernel and frame.kernel:
        name += KERNEL_SUFFIX
    return clean(name)


def is_firmware(frame: Frame) -> bool:
    return frame.module is not None and frame.module.name == FIRMWARE_NAME and not frame.kernel


def clean(name: str) -> str:
    """Folded stacks separate frames with ';' and stacks with newlines: neither may appear."""
    return name.replace(";", ":").replace("\n", " ")


def thread_name(process: Process) -> str:
    """A thread of a guest that tells threads apart: its name (the program's when the guest
    names no thread), pid and tid."""
    name = process.thread or process.program or UNKNOWN
    return clean(f"{name} ({process.pid}/{process.tid})")


def context_name(process: Process | None) -> str:
    return KERNEL_ROOT if process is None else clean(process.label)


def visible(frames: Sequence[Frame], naming: Naming) -> list[Frame]:
    """The frames a naming shows: inlined frames only when it names source lines."""
    if naming.detail is Detail.LINE:
        return list(frames)
    return [f for f in frames if not f.inlined]


def stop_marker(stop: StopReason) -> str | None:
    """The frame put under the root of a stack whose walk ended this way, if any."""
    if stop is StopReason.USER_GONE:
        return USER_GONE
    return None if stop.whole else TRUNCATED


def stack_names(
    process: Process | None,
    frames: Sequence[Frame],
    stop: StopReason,
    naming: Naming,
    state: str | None = None,
) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """Names of a stack's frames root first, the context (process or ``kernel``) as the root,
    ``[off-cpu: S]`` under it for a task off CPU in state S, and ``[truncated]`` next when the
    walk did not reach the outermost frame (``[user space gone]`` when the process's user space
    was released); and for each name whether it is kernel code (writers colour by it). A
    sample of the firmware is ``[firmware]`` alone: it belongs to no process or kernel, and
    its stack is not walked."""
    if process is None and state is None and frames and is_firmware(frames[0]):
        return (frame_name(frames[0], naming, False),), (False,)
    mark = naming.mark_kernel and process is not None
    shown = visible(frames, naming)[::-1]
    names = [context_name(process)]
    kernel = [False]
    if state is not None:
        names.append(off_cpu_name(state))
        kernel.append(False)
    root = stop_marker(stop)
    if root is not None:
        names.append(root)
        kernel.append(False)
    names += (frame_name(f, naming, mark) for f in shown)
    kernel += (f.kernel for f in shown)
    return tuple(names), tuple(kernel)
