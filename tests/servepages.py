"""qmpprof serve run and read back as a client does: the daemon started (``serve_command``,
``Served``), a page fetched over HTTP (its status, type and body, errors included), the
Prometheus text format parsed and held to its rules, and a guest's run state."""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from guestvm import Guest, run_state


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str  # ends with "/"

    def metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        status, _, body = get(self.url + "metrics")
        assert status == 200
        return parse_prometheus(body.decode())

    def per_vm(self, name: str) -> dict[str, float]:
        """The metric ``name`` by its ``vm`` label."""
        return {dict(labels)["vm"]: value for labels, value in self.metrics().get(name, {}).items()}

    def samples(self) -> dict[str, float]:
        """Each VM's samples so far."""
        return self.per_vm("qmpprof_samples_total")

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err


@contextmanager
def serve_command(*args: str, cwd: Path | None = None) -> Iterator[Served]:
    """``qmpprof serve --listen 127.0.0.1:0 ARGS`` running, once it says where it listens;
    stopped by SIGTERM after."""
    argv = [sys.executable, "-m", "qmpprof", "serve", "--listen", "127.0.0.1:0", *args]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, line + proc.communicate(timeout=30)[1]
        yield Served(proc, found[0])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def parse_prometheus(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Samples per metric name and label set, holding the text format's rules: HELP and TYPE
    before a family's samples, names and labels well formed, histograms cumulative with +Inf
    equal to _count, and a final newline."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    name_re = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    for line in text.splitlines():
        if line.startswith("#"):
            kind = re.fullmatch(rf"# (HELP|TYPE) ({name_re}) (.+)", line)
            assert kind, line
            if kind[1] == "TYPE":
                assert kind[3] in ("counter", "gauge", "histogram", "summary", "untyped"), line
                types[kind[2]] = kind[3]
            continue
        sample = re.fullmatch(rf"({name_re})(?:\{{(.*)\}})? (\S+)", line)
        assert sample, line
        name, labels = sample[1], []
        for label in re.finditer(r'([a-zA-Z_]\w*)="((?:[^"\\\n]|\\.)*)"(?:,|$)', sample[2] or ""):
            labels.append((label[1], label[2]))
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or types.get(family) == "histogram", f"no TYPE before {line}"
        value = float(sample[3])
        assert not math.isnan(value), line
        out.setdefault(name, {})[tuple(sorted(labels))] = value  # their order means nothing
    for family in (f for f, kind in types.items() if kind == "histogram"):
        for labels, count in out.get(f"{family}_count", {}).items():
            buckets = [
                (float(dict(key)["le"]), value)
                for key, value in out[f"{family}_bucket"].items()
                if [kv for kv in key if kv[0] != "le"] == list(labels)
            ]
            values = [value for _, value in sorted(buckets)]
            assert values == sorted(values) and values[-1] == count
            assert sorted(buckets)[-1][0] == math.inf
    return out


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read()


def status(guest: Guest) -> str:
    return run_state(guest.qmp_socket)
