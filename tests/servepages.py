"""qmpprof serve read back as a client does: a page fetched over HTTP (its status, type and
body, errors included), the Prometheus text format parsed and held to its rules, and a guest's
run state."""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.request

from guestvm import Guest, run_state


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
