"""serve's HTTP endpoints, on the standard library's ThreadingHTTPServer in threads of its own.

Requests are answered in their own threads, never in the sampling loop: a profile is merged
from the ring's immutable seconds and rendered there, so rendering never lengthens a pause.

    /                      index: the VMs, their live numbers, links
    /debug/pprof/profile   ?seconds=N&vm=NAME: collect N seconds from now (Go's convention),
                           answer with a gzipped profile.proto
    /flamegraph.svg        ?seconds=N&vm=NAME: the last N seconds, at once, as an SVG
    /metrics               Prometheus text format
    /healthz               "ok"

``vm`` may be left out when serve follows one VM. Errors are one line of text/plain.
"""

from __future__ import annotations

import http.server
import math
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qmpprof.naming import Naming
from qmpprof.output import render
from qmpprof.output.facts import BOUNDARY_KEY
from qmpprof.profile import Profile
from qmpprof.serve import metrics, views
from qmpprof.serve.ring import SecondSlice, merge
from qmpprof.serve.vm import FLUSH, Vm
from qmpprof.stats import TRUSTED_SAMPLES, few_samples_margin

GRACE = 3 * FLUSH  # how long a profile request waits past its N seconds for the last second


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ServeState:
    """What the handlers read: the VMs (a tuple the daemon replaces whole) and settings."""

    window: int
    naming: Naming
    vms: tuple[Vm, ...] = ()
    closing: threading.Event = field(default_factory=threading.Event)  # serve is stopping
    scrape: Callable[[], bytes] = field(init=False)  # the metrics of ``vms``, as text

    def __post_init__(self) -> None:
        self.scrape = metrics.scraper(lambda: self.vms)

    def pick(self, query: dict[str, list[str]]) -> Vm:
        vms = self.vms
        names = query.get("vm")
        if names:
            for vm in vms:
                if vm.name == names[-1]:
                    return vm
            raise HttpError(404, f"no VM named {names[-1]!r}")
        if len(vms) == 1:
            return vms[0]
        if not vms:
            raise HttpError(404, "no VM to profile yet")
        raise HttpError(400, f"several VMs: add vm=NAME ({', '.join(v.name for v in vms)})")

    def seconds(self, query: dict[str, list[str]]) -> int:
        text = (query.get("seconds") or [str(min(views.DEFAULT_SECONDS, self.window))])[-1]
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= self.window:
            raise HttpError(400, f"seconds must be a whole number from 1 to {self.window}")
        return int(text)


class Handler(http.server.BaseHTTPRequestHandler):
    board: ServeState  # set on the subclass serve() makes
    server_version = "qmpprof"

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        route: dict[str, Callable[[dict[str, list[str]]], tuple[str, bytes]]] = {
            "/": lambda q: ("text/html; charset=utf-8", self._index()),
            "/healthz": lambda q: ("text/plain; charset=utf-8", b"ok\n"),
            "/metrics": lambda q: (metrics.CONTENT_TYPE, self.board.scrape()),
            "/flamegraph.svg": self._flamegraph,
            "/debug/pprof/profile": self._pprof,
        }
        try:
            answer = route.get(url.path)
            if answer is None:
                raise HttpError(404, f"no such page: {url.path}")
            kind, body = answer(query)
        except HttpError as err:
            self._send(err.status, "text/plain; charset=utf-8", f"{err}\n".encode())
            return
        except Exception as err:  # a bug: one line to the client, serve goes on
            line = f"internal error: {type(err).__name__}: {err}\n"
            self._send(500, "text/plain; charset=utf-8", line.encode())
            return
        self._send(200, kind, body)

    def _index(self) -> bytes:
        return views.index(self.board.vms, self.board.window).encode()

    def _flamegraph(self, query: dict[str, list[str]]) -> tuple[str, bytes]:
        vm, seconds = self.board.pick(query), self.board.seconds(query)
        # By time, not by entry: under a budget one entry of the ring spans an interval (5 s at
        # most) when that is longer than a second.
        since = time.monotonic() - seconds
        picked = [s for s in vm.ring.last(seconds) if s.end > since]
        return "image/svg+xml", render(self._profile(vm, picked, seconds), "svg", self.board.naming)

    def _pprof(self, query: dict[str, list[str]]) -> tuple[str, bytes]:
        vm, seconds = self.board.pick(query), self.board.seconds(query)
        start = time.monotonic()
        end = start + seconds
        if self.board.closing.wait(seconds):
            raise HttpError(503, "serve is stopping")
        while not _sealed(vm.ring.seconds, end) and time.monotonic() < end + GRACE:
            if self.board.closing.wait(FLUSH / 4):
                raise HttpError(503, "serve is stopping")
        picked = [s for s in vm.ring.seconds if start <= (s.start + s.end) / 2 <= end]
        return "application/octet-stream", render(
            self._profile(vm, picked, seconds), "pprof", self.board.naming
        )

    def _profile(self, vm: Vm, picked: Sequence[SecondSlice], seconds: int) -> Profile:
        interval_ms = vm.interval * 1e3  # the one in force (a budget may have lengthened it)
        samples = sum(s.samples for s in picked)
        facts = {
            "guest": vm.name,
            "samples": str(samples),
            "interval": f"{interval_ms:.3g} ms",
            "seconds": f"last {seconds} s",
        }
        if vm.boundary is not None:
            facts[BOUNDARY_KEY] = f"{vm.boundary:#x}"
        short = too_short(samples, seconds)
        if short is not None:
            facts["note"] = short
        return merge(picked, interval_ms, facts)

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """One line per request is noise for a daemon polled every few seconds."""


def too_short(samples: int, seconds: int) -> str | None:
    """What a profile of ``samples`` over ``seconds`` says when they are too few for its
    shares to mean much (the budget sets the rate: a window too short for it says so), with
    the window that would hold enough at the same rate; None when they are enough."""
    margin = few_samples_margin(samples) if samples else 100.0
    if margin is None:
        return None
    enough = math.ceil(seconds * TRUSTED_SAMPLES / samples) if samples else None
    ask = f"ask for {enough} s or more" if enough is not None else "ask for a longer window"
    return (
        f"only {samples} samples in {seconds} s at the interval in force: a share is known to"
        f" +-{margin:.0f} points (95 %); {ask}"
    )


def _sealed(seconds: tuple[SecondSlice, ...], end: float) -> bool:
    return bool(seconds) and seconds[-1].end >= end


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """One line, not the standard library's traceback; a client that went away (a
        profile request given up on) is not worth one."""
        err = sys.exc_info()[1]
        if not isinstance(err, ConnectionError):
            print(f"qmpprof: http: {type(err).__name__}: {err}", file=sys.stderr)


def listen(host: str, port: int, board: ServeState) -> Server:
    """A server bound now (so a busy port fails at start); ``serve_forever`` it in a thread."""
    handler = type("BoundHandler", (Handler,), {"board": board})
    return Server((host, port), handler)
