"""Writers: one module per output format behind the Writer Protocol, and atomic file output."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

from qmpprof.errors import UsageError
from qmpprof.output import folded, speedscope, svg
from qmpprof.profile import Profile


class Writer(Protocol):
    def __call__(self, profile: Profile) -> str: ...


WRITERS: dict[str, Writer] = {
    "folded": folded.render,
    "speedscope": speedscope.render,
    "svg": svg.render,
}

# Longest suffix first, so that ".speedscope.json" wins over ".json".
EXTENSIONS: tuple[tuple[str, str], ...] = (
    (".speedscope.json", "speedscope"),
    (".folded", "folded"),
    (".json", "speedscope"),
    (".svg", "svg"),
    (".txt", "folded"),
)


def format_for(path: Path, fmt: str | None) -> str:
    """The format named by ``fmt``, else the one the file name implies, else folded."""
    if fmt is not None:
        if fmt not in WRITERS:
            raise UsageError(f"unknown format {fmt!r} (choose from {', '.join(sorted(WRITERS))})")
        return fmt
    name = path.name.lower()
    for suffix, found in EXTENSIONS:
        if name.endswith(suffix):
            return found
    return "folded"


def write_profile(profile: Profile, path: Path, fmt: str | None = None) -> str:
    """Render ``profile`` and write it to ``path`` atomically (a reader never sees half a file).

    Returns the format used.
    """
    chosen = format_for(path, fmt)
    text = WRITERS[chosen](profile)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return chosen
