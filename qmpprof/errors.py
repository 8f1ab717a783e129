"""The one root exception of qmpprof and its tree.

Every error a user can cause or meet maps to one line on stderr and an exit code::

    QmpprofError                 exit 1   anything qmpprof reports to the user
    ├── UsageError               exit 2   bad command-line value
    ├── ConnectError             exit 3   no socket, refused, not a QMP server
    │   └── VmBusyError          exit 3   another qmpprof is profiling this VM
    ├── GuestGoneError           exit 4   QEMU closed the connection mid-run
    ├── TransportError           exit 5   QEMU answered with an error we cannot handle
    │   ├── MemoryReadError      exit 5   guest memory not mapped / not readable
    │   └── GuestHeldError       exit 5   something else stopped the guest mid-run
    ├── ElfError                 exit 6   unreadable or malformed ELF file
    │   ├── KernelImageError     exit 6   a kernel image (bzImage, vmlinux) with no usable part
    │   └── SymbolMapError       exit 6   a System.map or /proc/kallsyms text that cannot be read
    ├── ProfileError             exit 7   a saved profile that cannot be read back
    ├── OutputError              exit 8   an output file that cannot be written
    ├── KernelMismatchError      exit 9   the running kernel cannot be matched with its image
    └── DescribeError            exit 10  a kernel description (--describe) that does not fit

Each class that brings an exit code says what it means in a few words (``meaning``):
``exit_codes`` lists them for ``--help``; README.md's exit-code table says the same to users at
length (a test holds the three together).

Failures inside one sample (a truncated stack, an unreadable page) are data, not exceptions:
the sampler counts them and reports them at the end.
"""

from __future__ import annotations


class QmpprofError(Exception):
    """Root of every error qmpprof reports to the user."""

    exit_code = 1
    meaning = "another error qmpprof reports"  # in --help's list of exit codes


class UsageError(QmpprofError):
    """A command-line value is wrong."""

    exit_code = 2
    meaning = "a bad command line"


class ConnectError(QmpprofError):
    """Could not connect to QEMU, or the peer is not a QMP server / gdbstub."""

    exit_code = 3
    meaning = "no QMP there"


class VmBusyError(ConnectError):
    """Another qmpprof run holds the VM (transport/vmmark.py); the message names it."""


class GuestGoneError(QmpprofError):
    """QEMU went away (socket closed) while qmpprof was using it."""

    exit_code = 4
    meaning = "QEMU went away"


class TransportError(QmpprofError):
    """QEMU answered a command with an error."""

    exit_code = 5
    meaning = "QEMU refused"


class MemoryReadError(TransportError):
    """Guest memory at an address could not be read (unmapped page). ``readable``: the bytes
    from ``addr`` on that were read before the first unreadable one, when the transport knows
    (the gdbstub answers each 2 KiB on its own); None when it does not (QMP)."""

    def __init__(
        self, addr: int, size: int, detail: str = "", readable: bytes | None = None
    ) -> None:
        self.addr = addr
        self.size = size
        self.readable = readable
        suffix = f": {detail}" if detail else ""
        super().__init__(f"cannot read {size} bytes of guest memory at {addr:#x}{suffix}")


class GuestHeldError(TransportError):
    """Something other than qmpprof (another QMP client, a debugger) stopped the guest between
    two of qmpprof's samples: the run ends and leaves it as that left it."""

    def __init__(self, state: str) -> None:
        self.state = state
        super().__init__(
            f"something else stopped the guest (QEMU says {state}): the run ends here, and"
            " leaves it so"
        )


class ElfError(QmpprofError):
    """An ELF file is missing, unreadable or malformed."""

    exit_code = 6
    meaning = "a bad kernel or ELF file"

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"{path}: not a usable ELF file: {detail}")


class KernelImageError(ElfError):
    """A Linux kernel file: a bzImage whose payload cannot be unpacked, or a vmlinux whose
    kallsyms tables cannot be found."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        QmpprofError.__init__(self, f"{path}: not a usable kernel image: {detail}")


class SymbolMapError(ElfError):
    """A System.map or /proc/kallsyms text file with no usable symbol lines."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        QmpprofError.__init__(self, f"{path}: not a usable symbol map: {detail}")


class ProfileError(QmpprofError):
    """A saved profile (``qmpprof report``'s input) is missing, unreadable or not one of ours."""

    exit_code = 7
    meaning = "a bad saved profile"

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"{path}: not a readable qmpprof profile: {detail}")


class OutputError(QmpprofError):
    """An output file cannot be written (its folder is gone, no space, no permission)."""

    exit_code = 8
    meaning = "an output not written"

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"cannot write {path}: {detail}")


class KernelMismatchError(QmpprofError):
    """The kernel running in the guest cannot be matched with the kernel image given: no KASLR
    slide makes the image's symbols fit what the guest shows (another kernel, or not booted)."""

    exit_code = 9
    meaning = "the kernel file is not the running kernel"

    def __init__(self, detail: str) -> None:
        super().__init__(f"running kernel does not match the image: {detail}")


class NoKernelRunningError(KernelMismatchError):
    """No vCPU ran the kernel while the slide was looked for (every vCPU in user code, where
    the kernel may be unmapped): nothing to match the image against."""


class DescribeError(QmpprofError):
    """A kernel description (``--describe``) that cannot be read, or whose expressions do not
    fit the kernel's DWARF: the message names the key and the term."""

    exit_code = 10
    meaning = "a bad kernel description"

    def __init__(self, detail: str) -> None:
        super().__init__(f"kernel description {detail}")


def exit_codes() -> dict[int, str]:
    """Every exit code of the tree, with the meaning of the class nearest the root that has it,
    in order of code."""
    found: dict[int, str] = {}
    classes: list[type[QmpprofError]] = [QmpprofError]
    while classes:
        cls = classes.pop(0)
        found.setdefault(cls.exit_code, cls.meaning)
        classes += cls.__subclasses__()
    return dict(sorted(found.items()))
