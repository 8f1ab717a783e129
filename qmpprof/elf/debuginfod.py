"""Debug files by build-id from debuginfod servers, as elfutils' client (gdb's, perf's)
fetches them, so that each reuses what the other fetched.

The client's conventions: the servers in ``DEBUGINFOD_URLS`` (space-separated, tried in
order), ``GET <server>/buildid/<hex>/debuginfo``; the cache in ``$DEBUGINFOD_CACHE_PATH``,
else ``$XDG_CACHE_HOME/debuginfod_client``, else ``~/.cache/debuginfod_client``, one folder
per build-id holding ``debuginfo`` (a file in the cache is used without asking any server);
``DEBUGINFOD_TIMEOUT`` seconds (90 unless set) without a byte from a server give up on it.
A large file shows a progress bar on a terminal (tqdm). Fetches happen while files load,
before the guest is touched: never inside a pause.

Nothing here fails a run: a server that does not answer, lacks the file or breaks off gives
one line (``Fetched.note``), and the run goes on without what it would have brought. A server
that gave no answer within the timeout is not asked again for QUIET_FOR seconds (a run's other
files, a daemon's next VMs): its timeouts do not add up file after file.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from qmpprof.elf.image import ElfImage
from qmpprof.errors import ElfError

DEFAULT_TIMEOUT = 90.0  # elfutils' own default
QUIET_FOR = 300.0  # seconds a server that did not answer is left alone
_quiet: dict[str, float] = {}  # a server -> when it failed to answer (time.monotonic)
CHUNK = 1 << 20
BAR_FROM = 8 << 20  # files this large get a progress bar


@dataclass(frozen=True, slots=True)
class Fetched:
    path: Path | None  # the file in the cache, or None
    note: str | None = None  # why not, when a server was asked and none had it


def servers() -> list[str]:
    return [url.rstrip("/") for url in os.environ.get("DEBUGINFOD_URLS", "").split()]


def cache_dir() -> Path:
    own = os.environ.get("DEBUGINFOD_CACHE_PATH")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "debuginfod_client"


def timeout() -> float:
    try:
        value = float(os.environ.get("DEBUGINFOD_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT
    return value if 0 < value < float("inf") else DEFAULT_TIMEOUT


def debuginfo(build_id: str, what: str) -> Fetched:
    """The debug file of ``build_id`` (``what`` names it in notes: "the kernel"), from the
    cache or the first server that has it; ``Fetched(None)`` with no servers set."""
    build_id = build_id.lower()
    if not build_id or any(c not in "0123456789abcdef" for c in build_id):
        return Fetched(None, f"debuginfod: {what} has no usable build-id")
    cached = cache_dir() / build_id / "debuginfo"
    if cached.is_file() and cached.stat().st_size > 0:
        return Fetched(cached)
    urls = servers()
    if not urls:
        return Fetched(None)
    why = []
    for server in urls:
        since = _quiet.get(server)
        if since is not None and time.monotonic() - since < QUIET_FOR:
            why.append(f"{server}: no answer within {timeout():g} s before: not asked again")
            continue
        try:
            _download(f"{server}/buildid/{build_id}/debuginfo", cached, what)
            return Fetched(cached)
        except urllib.error.HTTPError as err:
            why.append(f"{server}: {err.code} {err.reason}")
        except (OSError, ValueError, http.client.HTTPException) as err:  # refused, timed out,
            # broken off, a bad URL or reply
            if _timed_out(err):
                _quiet[server] = time.monotonic()
            why.append(f"{server}: {_reason(err)}")
    return Fetched(None, f"debuginfod: no debug file for {what} ({build_id}): {'; '.join(why)}")


def debug_image(build_id: str, what: str) -> tuple[ElfImage | None, str | None]:
    """The debug file of ``build_id`` (``debuginfo``), loaded (mapped: a debug vmlinux is
    hundreds of MB) and checked to carry that build-id; else None and what to tell (None:
    nothing, no server being set)."""
    found = debuginfo(build_id, what)
    if found.path is None:
        return None, found.note
    try:
        debug = ElfImage.load(found.path, mapped=True)
    except ElfError as err:
        return None, f"debuginfod: the debug file of {what} is not usable: {err}"
    if debug.build_id != build_id.lower():
        return None, f"debuginfod: {found.path} is not the debug file of {what} ({debug.build_id})"
    return debug, None


def _timed_out(err: BaseException) -> bool:
    """No answer within the timeout: while reading, or connecting (wrapped by urllib)."""
    return isinstance(err, TimeoutError) or (
        isinstance(err, urllib.error.URLError) and isinstance(err.reason, TimeoutError)
    )


def _reason(err: BaseException) -> str:
    if _timed_out(err):
        return f"no answer within {timeout():g} s (DEBUGINFOD_TIMEOUT)"
    if isinstance(err, urllib.error.URLError):
        return str(err.reason)
    return str(err) or type(err).__name__


def _download(url: str, target: Path, what: str) -> None:
    """``url`` into ``target``, whole or not at all (a temporary file renamed)."""
    with urllib.request.urlopen(url, timeout=timeout()) as reply:
        size = int(reply.headers.get("Content-Length") or 0)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=".debuginfo.")
        try:
            with os.fdopen(fd, "wb") as out:
                got = _copy(reply, out, size, what)
            if size and got != size:
                raise ValueError(f"broken off after {got} of {size} bytes")
            os.replace(name, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name)
            raise


def _copy(reply: BinaryIO, out: BinaryIO, size: int, what: str) -> int:
    bar = None
    if size >= BAR_FROM and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"debuginfod: {what}", leave=False)
    got = 0
    try:
        while chunk := reply.read(CHUNK):
            out.write(chunk)
            got += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return got
