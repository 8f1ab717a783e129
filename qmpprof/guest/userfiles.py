"""The files of a guest's root filesystem as the user copied them (``--user-dir`` for a Linux
guest): ELF files found by the name a mapping gives, checked against the guest's own bytes.

The tree is walked once, when the run starts, for names only; an ELF is read and indexed the
first time a mapping names it, and kept; inside a pause it is not (``match(..., load=False)``):
a name seen then is only noted (``unread``) and read between samples (``read_one``). A
candidate is taken when its bytes at the mapping's file offset equal what the guest has there
(user code is not patched at run time), or, when the guest's page is not resident, by name
alone.

With ``lines`` (source lines wanted), a file without DWARF gets its debug file by build-id
from debuginfod servers (``DEBUGINFOD_URLS``, the client's cache first) when it is read: so
between samples too, never inside a pause. A server that lacks it or does not answer is told
in one line (``tell``); the file is used without lines.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from qmpprof.elf.image import ElfImage
from qmpprof.errors import ElfError, UsageError

MAX_FILES = 500_000


def _note(line: str) -> None:
    """A line for the user, told as the run goes (a file is read between samples too)."""
    print(f"qmpprof: note: {line}", file=sys.stderr)


class UserFiles:
    def __init__(
        self, root: Path | None, *, lines: bool = False, tell: Callable[[str], None] = _note
    ) -> None:
        self.lines = lines  # fetch the debug files of files without DWARF
        self.tell = tell
        self._by_name: dict[str, list[Path]] = {}
        self._images: dict[Path, ElfImage | None] = {}
        self.unread: set[str] = set()  # names a pause met whose files are not read yet
        if root is None:
            return
        if not root.is_dir():
            raise UsageError(f"--user-dir {root}: not a directory")
        count = 0
        for folder, _dirs, files in os.walk(root):
            for name in files:
                self._by_name.setdefault(name, []).append(Path(folder) / name)
                count += 1
            if count > MAX_FILES:
                break

    def candidates(self, name: str) -> list[ElfImage]:
        """The readable ELF files of this name (read and indexed once: no longer unread)."""
        self.unread.discard(name)
        out = []
        for path in self._by_name.get(name, ()):
            if path not in self._images:
                self._images[path] = self._load(path)
            image = self._images[path]
            if image is not None:
                out.append(image)
        return out

    def _load(self, path: Path) -> ElfImage | None:
        try:
            image = ElfImage.load(path)
        except ElfError:
            return None
        if self.lines and image.build_id and not image.has_section(".debug_line"):
            # Imported here: its HTTP client (http.client, email) serves this case alone.
            from qmpprof.elf import debuginfod

            image.debug, note = debuginfod.debug_image(image.build_id, str(path))
            if note is not None:
                self.tell(note)
        return _prepared(image)

    def read(self, name: str) -> bool:
        """Whether every file of this name was read already (or there is none)."""
        return all(path in self._images for path in self._by_name.get(name, ()))

    def read_one(self) -> bool:
        """Read the files of one name a pause noted; False when none is left."""
        if not self.unread:
            return False
        self.candidates(self.unread.pop())
        return True

    def match(
        self, name: str, offset: int, code: bytes | None, *, load: bool = True
    ) -> ElfImage | None:
        """The file named ``name`` whose bytes at file ``offset`` are ``code`` (None: not known,
        then the first file of that name). ``load=False`` (inside a pause): files not read yet
        are not read but noted in ``unread``, and give None."""
        if not load and not self.read(name):
            self.unread.add(name)
            return None
        found = self.candidates(name)
        if code is None:
            return found[0] if found else None
        for image in found:
            if image.file_bytes(offset, len(code)) == code:
                return image
        return None


def _prepared(image: ElfImage) -> ElfImage:
    """What samples of the file may need, built now (between samples), with where its
    functions may start (0.13 s for busybox's 1.5 MB of code, 0.07 s for libc's 1.4 MB), which
    the walk through code with no CFI asks for (unwind/scan.py)."""
    image.prepare()
    _ = image.function_starts
    return image
