"""The Linux kernels loaded for the process (a few, by the files' identity), and the
``guest.LinuxGuest`` a run gets from one: serve's VMs running the same kernel, and a VM
connecting again, share one load; what a guest learns when attached lives in its own
``LinuxGuest``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from qmpprof.elf.image import ElfImage
from qmpprof.errors import UsageError
from qmpprof.guest.base import GuestSpec
from qmpprof.guest.userfiles import UserFiles
from qmpprof.linux import initramfs
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.guest import LinuxGuest
from qmpprof.memo import Memo

KEPT = 8  # loaded kernels kept for the process
FileId = tuple[str, int, int, int, int] | None  # path, device, inode, size, mtime


def _file_id(path: Path | None) -> FileId:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return (str(path), -1, -1, -1, -1)  # the load says why it cannot be read
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_loaded: Memo[tuple[FileId, FileId], LinuxKernel] = Memo(KEPT)
_loading = threading.Lock()  # one load at a time: a second VM of the same kernel waits for it


def load_kernel(path: Path, kallsyms: Path | None) -> LinuxKernel:
    """The kernel of these files, loaded once for the process (the files' identity changes
    with their contents: a kernel replaced in place is loaded again)."""
    key = (_file_id(path), _file_id(kallsyms))
    with _loading:
        found = _loaded.get(key)
        if found is None:
            found = _loaded.put(key, LinuxKernel.load(path, kallsyms).prepare())
    return found


def linux_guest(spec: GuestSpec) -> LinuxGuest:
    """The guest of a run with ``--os linux``, its kernel loaded (or found loaded)."""
    if spec.kernel is None:
        raise UsageError("--os linux needs --kernel (the vmlinuz or vmlinux the guest booted)")
    kernel = load_kernel(spec.kernel.path, spec.path("kallsyms"))
    files = UserFiles(user_dir(spec), lines=spec.lines)
    debug, notes = debug_file(kernel) if spec.lines else (None, ())
    return LinuxGuest(kernel, kernel.image.arch, files, lines=spec.lines, debug=debug, notes=notes)


def user_dir(spec: GuestSpec) -> Path | None:
    """Where the guest's user programs are: ``--user-dir``, else the ``--initrd`` unpacked."""
    initrd = spec.path("initrd")
    if spec.user_dir is not None or initrd is None:
        return spec.user_dir
    return initramfs.unpacked(initrd)


def debug_file(kernel: LinuxKernel) -> tuple[ElfImage | None, tuple[str, ...]]:
    """Where the kernel's source lines come from when its image has no DWARF (a vmlinuz):
    the debug file debuginfod servers have for its build-id (``DEBUGINFOD_URLS``); and what
    to tell when none does."""
    image = kernel.image
    if image.lines is not None or image.build_id is None:
        return None, ()
    # Imported here: its HTTP client (http.client, email) serves this case alone.
    from qmpprof.elf import debuginfod

    debug, note = debuginfod.debug_image(image.build_id, "the kernel")
    return debug, () if note is None else (note,)
