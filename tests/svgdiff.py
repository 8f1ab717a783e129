"""Reading a differential flame graph SVG back: each frame's fill and tooltip, the legend, and
which fills are the reds and blues of a grown or shrunk share."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

NS = {"s": "http://www.w3.org/2000/svg"}


def red(fill: str) -> bool:
    r, g, b = map(int, re.findall(r"\d+", fill))
    return r == 255 and g == b < 220


def blue(fill: str) -> bool:
    r, g, b = map(int, re.findall(r"\d+", fill))
    return b == 255 and r == g < 220


def legend_of(text: str) -> list[str]:
    return [t.text or "" for t in ET.fromstring(text).iterfind("s:text", NS) if t.get("y") == "58"]


def tooltips(text: str) -> dict[tuple[str, int], tuple[str, str]]:
    """(fill, tooltip) per (frame name, depth)."""
    out = {}
    for g in ET.fromstring(text).iterfind(".//s:g[@class='f']", NS):
        tip = g.findtext("s:title", namespaces=NS) or ""
        rect = g.find("s:rect", NS)
        assert rect is not None
        out[tip[: tip.rindex(" (")], int(g.attrib["data-d"])] = (rect.attrib["fill"], tip)
    return out
