"""Linux as a guest OS (``guest.base.GuestOs``, registered as ``--os linux``): the kernel loaded
from its files, then a ``guest.LinuxGuest`` for the run (``kernels``).

Every run imports the guest OS registry, and with it this: Linux's readers are imported when a
run asks about a kernel file or chooses Linux, so that a run of another guest OS starts without
them (about 60 ms of CPU at every start, by python -X importtime on a loaded 2-core host).
"""

from __future__ import annotations

from qmpprof.guest.base import Guest, GuestOption, GuestSpec, KernelFile

KALLSYMS = GuestOption(
    "kallsyms",
    "FILE",
    "a Linux kernel's symbols as System.map or /proc/kallsyms text (default: the kallsyms"
    " tables inside --kernel)",
    symbols=True,
)
INITRD = GuestOption(
    "initrd",
    "FILE",
    "the initramfs the guest booted (QEMU's -initrd): its programs and libraries, unpacked"
    " into qmpprof's cache, when no --user-dir is given",
    booted="initrd",
)


class LinuxOs:
    """``--os linux``; ``auto`` takes it for a kernel file that is a Linux image."""

    name = "linux"
    options = (KALLSYMS, INITRD)

    def recognises(self, kernel: KernelFile | None) -> bool:
        if kernel is None:
            return False
        from qmpprof.linux.kernel import looks_like_linux  # imported here: see the docstring

        return looks_like_linux(kernel.head, kernel.elf)

    def load(self, spec: GuestSpec) -> Guest:
        from qmpprof.linux.running.kernels import linux_guest  # imported here: see the docstring

        return linux_guest(spec)


LINUX = LinuxOs()
