"""The output formats, one registry entry each (renderer, file extensions, text or binary, how
to view the file), and atomic file output. A new format is a module with ``render`` and one
entry in FORMATS.

Each renderer imports its writer's module when called: a run imports the writers of the formats
it writes, not every one (a start-up every command pays).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qmpprof.errors import OutputError, UsageError
from qmpprof.naming import Naming
from qmpprof.profile import Profile

Renderer = Callable[[Profile, Naming], str | bytes]


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    render: Renderer  # returns bytes when ``binary``, else text
    extensions: tuple[str, ...]  # lower case, the first is what qmpprof names such files
    binary: bool
    viewer: str  # how to look at it, with {path}
    lines: bool = False  # holds source lines whatever the naming: the sampler resolves them


def _folded(profile: Profile, naming: Naming) -> str:
    import qmpprof.output.folded as folded

    return folded.render(profile, naming)


def _svg(profile: Profile, naming: Naming) -> str:
    import qmpprof.output.svg as svg

    return svg.render(profile, naming)


def _speedscope(profile: Profile, naming: Naming) -> str:
    import qmpprof.output.speedscope as speedscope

    return speedscope.render(profile, naming)


def _native(profile: Profile, naming: Naming) -> bytes:
    import qmpprof.output.native as native

    return native.render(profile, naming)


def _pprof(profile: Profile, naming: Naming) -> bytes:
    import qmpprof.output.pprof as pprof

    return pprof.render(profile, naming)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("folded", _folded, (".folded", ".txt"), False,
               "flamegraph.pl {path} > flame.svg (or load it at https://www.speedscope.app)"),
        Format("svg", _svg, (".svg",), False, "open {path} in a web browser"),
        Format("speedscope", _speedscope, (".speedscope.json", ".json"), False,
               "load {path} at https://www.speedscope.app"),
        Format("qmpprof", _native, (".qmpprof",), True,
               "qmpprof report {path} -o flame.svg (any format, any naming)", lines=True),
        Format("pprof", _pprof, (".pb.gz", ".pprof"), True,
               "go tool pprof -http=: {path} (or -top, -traces)", lines=True),
    )
}  # fmt: skip

# Longest suffix first, so that ".speedscope.json" wins over ".json".
EXTENSIONS: tuple[tuple[str, str], ...] = tuple(
    sorted(
        ((ext, f.name) for f in FORMATS.values() for ext in f.extensions),
        key=lambda pair: -len(pair[0]),
    )
)


def format_for(path: Path, fmt: str | None) -> str:
    """The format named by ``fmt``, else the one the file name implies, else folded."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UsageError(f"unknown format {fmt!r} (choose from {', '.join(sorted(FORMATS))})")
        return fmt
    name = path.name.lower()
    for suffix, found in EXTENSIONS:
        if name.endswith(suffix):
            return found
    return "folded"


def render(profile: Profile, fmt: str, naming: Naming | None = None) -> bytes:
    """The file contents of ``profile`` in format ``fmt``."""
    out = FORMATS[fmt].render(profile, naming or Naming())
    # Names come from guest bytes: a lone surrogate becomes "?", never an error.
    return out if isinstance(out, bytes) else out.encode("utf-8", "replace")


def write_profile(
    profile: Profile, path: Path, fmt: str | None = None, naming: Naming | None = None
) -> str:
    """Render ``profile`` and write it to ``path`` atomically (a reader never sees half a file).

    Returns the format used.
    """
    chosen = format_for(path, fmt)
    write_atomic(path, render(profile, chosen, naming))
    return chosen


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader never sees half a file."""
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    except OSError as err:
        raise OutputError(str(path), err.strerror or str(err)) from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OutputError(str(path), err.strerror or str(err)) from None
        raise


def viewer_hint(fmt: str, path: Path) -> str:
    return FORMATS[fmt].viewer.format(path=path)
