"""The ``-o`` files of every command: checked before anything runs (a format for each name, a
folder that can be written), written at the end. ``-o -`` is standard output: in ``--format``,
else folded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TextIO

from qmpprof.errors import OutputError, UsageError
from qmpprof.naming import Naming
from qmpprof.output import EXTENSIONS, FORMATS, format_for, render, write_profile
from qmpprof.profile import Profile

STDOUT = Path("-")


def check(paths: Sequence[Path], fmt: str | None, formats: Collection[str] = FORMATS) -> None:
    """Every output has a format among ``formats`` and can be written; else a UsageError (the
    name) or an OutputError (the folder), before a run has anything to lose."""
    for path in paths:
        chosen = chosen_format(path, fmt)
        if chosen not in formats:
            wanted = " or ".join(formats)
            raise UsageError(f"-o {path}: this command writes {wanted}, not {chosen}")
        if path == STDOUT:
            if FORMATS[chosen].binary and sys.stdout.isatty():
                raise UsageError(f"-o - would print {chosen}'s binary data on the terminal")
            continue
        _check_folder(path)


def chosen_format(path: Path, fmt: str | None) -> str:
    """``--format``, else the format the name's extension names; standard output: folded."""
    if fmt is not None or path == STDOUT:
        return format_for(path, fmt)
    name = path.name.lower()
    for suffix, found in EXTENSIONS:
        if name.endswith(suffix):
            return found
    known = ", ".join(suffix for suffix, _ in sorted(EXTENSIONS, key=lambda pair: pair[1]))
    raise UsageError(f"-o {path}: no format has that extension (known: {known}); or give --format")


def _check_folder(path: Path) -> None:
    if path.is_dir():
        raise OutputError(str(path), "it is a directory")
    folder = path.parent
    if not folder.is_dir():
        missing = "no folder" if not folder.exists() else "not a folder:"
        raise OutputError(str(path), f"{missing} {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(str(path), f"no permission to write in {folder}")


def write(profile: Profile, path: Path, fmt: str | None, naming: Naming, out: TextIO) -> str:
    """``profile`` written to ``path`` (atomically), or to ``out`` for ``-``; the format used."""
    if path != STDOUT:
        return write_profile(profile, path, fmt, naming)
    chosen = format_for(path, fmt)
    emit(render(profile, chosen, naming), FORMATS[chosen].binary, out)
    return chosen


def emit(data: bytes, binary: bool, out: TextIO) -> None:
    """``data`` on standard output (``out``): bytes through its buffer when it has one."""
    buffer = getattr(out, "buffer", None)
    if binary and buffer is None:
        raise OutputError("-", "standard output here takes text only")
    try:
        if buffer is not None:
            out.flush()
            buffer.write(data)
            buffer.flush()
        else:
            out.write(data.decode("utf-8"))
            out.flush()
    except OSError as err:
        raise OutputError("-", err.strerror or str(err)) from None
