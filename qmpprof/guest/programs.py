"""The user programs a profiler knows: ELF files of ``--user-dir``, found by the hash of ``.text``.

A program is matched by content, not by name or address (every program of the bundled guest is
linked at the same address). The index is read-only after loading: a match never consumes an
entry, so every instance of a program gets its symbols.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from qmpprof.elf.image import ElfImage
from qmpprof.errors import UsageError

ELF_MAGIC = b"\x7fELF"


class ProgramIndex:
    def __init__(self, images: Sequence[ElfImage]) -> None:
        self.images = tuple(images)
        self._by_hash: dict[str, ElfImage] = {}
        for image in self.images:
            self._by_hash.setdefault(image.text_sha256, image)

    @classmethod
    def from_dir(cls, directory: Path) -> ProgramIndex:
        """Every ELF file directly in ``directory`` (other files are ignored).

        A file that starts like an ELF but cannot be parsed is an error: the user pointed us at it.
        """
        if not directory.is_dir():
            raise UsageError(f"--user-dir {directory}: not a directory")
        images = []
        for path in sorted(directory.iterdir()):
            if path.is_file() and _looks_like_elf(path):
                images.append(ElfImage.load(path))
        return cls(images)

    def match(self, text: bytes) -> ElfImage | None:
        """The program whose ``.text`` is exactly ``text``."""
        return self._by_hash.get(hashlib.sha256(text).hexdigest())

    def __len__(self) -> int:
        return len(self.images)


def _looks_like_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False
