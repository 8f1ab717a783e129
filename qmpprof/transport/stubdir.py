"""The private directory of qmpprof's gdbstub: made 0700 and locked while a run uses it, and
recognised later when a qmpprof killed outright (SIGKILL, a crash) left its stub in QEMU.

A gdbstub is a leftover of qmpprof's only when all of these hold:

- QEMU reports it as a Unix socket server nobody is connected to: query-chardev's filename of
  the chardev ``gdb`` is ``disconnected:unix:DIR/gdb.sock,server=on`` (QEMU 7.2);
- DIR's name is ``qmpprof-gdb-`` and mkdtemp's suffix, and DIR is a directory (not a link)
  owned by this user, mode 0700;
- no process holds DIR's lock: a running qmpprof holds an flock on DIR until it closes, and the
  kernel drops it when the process dies, however it died.

Anything else (a stub the user opened, another user's, a live run's) is never touched.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import tempfile

PREFIX = "qmpprof-gdb-"
SOCKET_NAME = "gdb.sock"
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# QEMU's filename of a listening Unix socket chardev without a client.
_LEFTOVER = re.compile(
    rf"disconnected:unix:(?P<dir>/[^,]*/{PREFIX}[A-Za-z0-9_]+)/{re.escape(SOCKET_NAME)}(,.*)?"
)


class StubDir:
    """A private directory holding the gdbstub's socket, locked by this process."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def make(cls) -> StubDir:
        """A new 0700 directory in the temporary directory (``/tmp`` when TMPDIR is too deep
        for a socket path), locked."""
        path = tempfile.mkdtemp(prefix=PREFIX)
        if len(os.path.join(path, SOCKET_NAME)) > _MAX_SOCKET_PATH:
            os.rmdir(path)
            path = tempfile.mkdtemp(prefix=PREFIX, dir="/tmp")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours alone: nobody else knows it yet
        return cls(path, fd)

    @property
    def socket(self) -> str:
        return os.path.join(self.path, SOCKET_NAME)

    def remove(self) -> None:
        """Delete the directory and what it holds, then let the lock go."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def release(self) -> None:
        """Let the lock go and keep the directory: the stub may still be in QEMU, and the next
        run recognises it by the directory (``leftover``)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def leftover(filename: str) -> StubDir | None:
    """The directory of the gdbstub whose query-chardev ``filename`` is given, locked by us, if
    it is one a dead qmpprof left (see the module); None when nothing proves that."""
    found = _LEFTOVER.fullmatch(filename)
    if found is None:
        return None
    path = found["dir"]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        mine = info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
        if mine:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises when a live run holds it
            return StubDir(path, fd)
    except OSError:
        pass
    os.close(fd)
    return None


def listening(path: str) -> bool:
    """Whether a process of this host listens on the Unix socket ``path`` (/proc/net/unix);
    True when that cannot be read (the safe answer: the stub may be there)."""
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as table:
            lines = table.read().splitlines()[1:]
    except OSError:
        return True
    # Num RefCount Protocol Flags Type St Inode Path; a listener has __SO_ACCEPTCON (0x10000).
    for line in lines:
        fields = line.split(maxsplit=7)
        if len(fields) == 8 and fields[7] == path and int(fields[3], 16) & 0x10000:
            return True
    return False
