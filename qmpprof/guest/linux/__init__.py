"""Linux as a guest OS, read from the kernel's own description: its image (``qmpprof.linux``
reads the bzImage, kallsyms, ORC and BTF), then, in the running guest, where it was loaded
(``slide``), its modules (``modules``), each vCPU's current task (``current``), the tasks
(``tasks``) and the processes' address spaces (``spaces``, ``vma``, ``pagetables``), put
together by ``guest.LinuxGuest``."""

from __future__ import annotations

from qmpprof.errors import UsageError
from qmpprof.guest.base import GuestSpec, KernelFile
from qmpprof.guest.linux.guest import LinuxGuest
from qmpprof.guest.userfiles import UserFiles
from qmpprof.linux.kernel import LinuxKernel, looks_like_linux


class LinuxOs:
    """``--os linux``; ``auto`` takes it for a kernel file that is a Linux image."""

    name = "linux"

    def recognises(self, kernel: KernelFile | None) -> bool:
        return kernel is not None and looks_like_linux(kernel.head, kernel.elf)

    def load(self, spec: GuestSpec) -> LinuxGuest:
        if spec.kernel is None:
            raise UsageError("--os linux needs --kernel (the vmlinuz or vmlinux the guest booted)")
        kernel = LinuxKernel.load(spec.kernel.path, spec.kallsyms).prepare()
        files = UserFiles(spec.user_dir)
        return LinuxGuest(kernel, kernel.image.arch, files, lines=spec.lines)


LINUX = LinuxOs()
