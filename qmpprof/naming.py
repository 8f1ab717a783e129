"""How frames become names, in one place: for every writer, the one-shot listing and the
top-stacks summary alike. A profile keeps frames as data; names are made from them only here.

One naming option: ``function`` (the default), ``offset`` (``function+0x1f``) or ``line``
(``function (file:line)``, with the functions inlined at a pc as frames of their own, marked
``_[i]``; without it inlined frames are folded into the function they were inlined in).

One rule for kernel code, wherever a frame is named (folded, SVG, speedscope, the top stacks,
a report, the one-shot listing): its name ends in ``_[k]``, in a process's stack and under the
``kernel`` root alike, as FlameGraph's tools mark it; a module a name already carries (a kernel
module's ``[name]``) is not named again. pprof alone names functions by their bare symbols (it
matches them itself; its mappings tell kernel code apart): ``plain_name``. docs/formats.md
writes the rule down.
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

    @classmethod
    def of(
        cls, *, offsets: bool = False, lines: bool = False, show_addresses: bool = False
    ) -> Naming:
        """From the command line's flags (--lines wins over --offsets)."""
        detail = Detail.LINE if lines else Detail.OFFSET if offsets else Detail.FUNCTION
        return cls(detail, show_addresses)


def frame_name(frame: Frame, naming: Naming) -> str:
    """A frame's name: ``plain_name``, and ``_[k]`` when it is kernel code."""
    name = plain_name(frame, naming)
    return name + KERNEL_SUFFIX if frame.kernel else name


def plain_name(frame: Frame, naming: Naming) -> str:
    """A frame's name without the kernel mark: the function (or its address) as the naming
    asks, the module where no symbol tells the code apart, ``_[i]`` on an inlined function."""
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
    module = _module_shown(frame, naming)
    if module is not None:
        name = f"{name} {module}"
    if frame.inlined:
        name += INLINED_SUFFIX
    return clean(name)


def _module_shown(frame: Frame, naming: Naming) -> str | None:
    """The module in brackets where a frame's name carries it: a kernel module's code, function
    [module]; code with no symbol, [unknown] [mapping]; a file's code no symbol covers (a
    stripped library's internal function), the file, and with --offsets where in it (its link
    address, as addr2line takes it)."""
    module = frame.module_name
    bracketed = module is not None and module.startswith("[") and module != UNKNOWN
    if bracketed and (frame.kernel or frame.symbol is None):
        return module
    if frame.symbol is None and not frame.kernel and frame.module and frame.module.path:
        where = frame.module.name
        if naming.detail is not Detail.FUNCTION:
            where += f"+{frame.pc - frame.module.bias:#x}"
        return f"[{where}]"
    return None


def names_module(frame: Frame) -> bool:
    """Whether the frame's name carries its module already (a listing adds it otherwise)."""
    return _module_shown(frame, Naming()) is not None


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
        return (frame_name(frames[0], naming),), (False,)
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
    names += (frame_name(f, naming) for f in shown)
    kernel += (f.kernel for f in shown)
    return tuple(names), tuple(kernel)
