"""SVG flame graph: one self-contained, interactive file that opens in any browser.

Root at the bottom, as in flamegraph.pl: the base is ``all``, above it the context of each sample
(a process label or ``kernel``), then its frames from outermost to leaf. Siblings are merged by
name and ordered alphabetically, so the x axis is not time: width is the share of samples.
Frames narrower than ``min_width`` pixels are not drawn (their samples still count in every
ancestor). Colours come from a hash of the name, in three families: kernel code (orange, as
FlameGraph's ``_[k]``), user code (red) and the synthetic roots and contexts (aqua).
"""

from __future__ import annotations

import hashlib
import html
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from qmpprof.naming import KERNEL_SUFFIX, TRUNCATED, Naming
from qmpprof.output.facts import summary, title
from qmpprof.output.flamegraph_js import SCRIPT, STYLE
from qmpprof.profile import NamedStack, Profile

WIDTH = 1200
PAD = 10  # left and right margin
FRAME_HEIGHT = 16
FONT_SIZE = 12
CHAR_WIDTH = FONT_SIZE * 0.59  # average Verdana advance, as flamegraph.pl estimates it
TOP = 76  # title and buttons, subtitle, legend
BOTTOM = 34  # the details line
MIN_WIDTH = 0.1  # pixels
ROOT = "all"

# family -> (base rgb, span added in proportion to the name's hash), FlameGraph's palettes.
PALETTES: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "kernel": ((190, 90, 0), (65, 65, 0)),
    "user": ((200, 50, 50), (55, 80, 80)),
    "root": ((50, 165, 165), (60, 55, 55)),
}

LEGEND = (("kernel", "kernel"), ("user", "user"), ("root", "context"))

# Characters XML 1.0 forbids even when escaped (symbol names are bytes from the guest).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


@dataclass(slots=True)
class _Node:
    name: str
    kernel: bool = False
    count: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Placed:
    node: _Node
    x: int  # samples to the left of the frame
    depth: int  # 0 is the ``all`` base


def _tree(profile: Profile, naming: Naming) -> _Node:
    root = _Node(ROOT)
    # Real runs repeat the same few stacks thousands of times: walk each distinct one once.
    unique: Counter[NamedStack] = Counter()
    for named, count in zip(profile.named(naming), profile.counts, strict=True):
        if count:
            unique[named] += count
    for named, count in unique.items():
        names, flags = named.names, named.kernel
        root.count += count
        node = root
        for name, kernel in zip(names, flags, strict=True):
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = _Node(name)
            node = child
            node.count += count
            node.kernel = node.kernel or kernel or name.endswith(KERNEL_SUFFIX)
    return root


def _place(root: _Node, min_samples: float) -> Iterator[_Placed]:
    # Iterative: a kernel stack can be deeper than Python's recursion limit likes.
    todo = [_Placed(root, 0, 0)]
    while todo:
        placed = todo.pop()
        yield placed
        x = placed.x
        for name in sorted(placed.node.children):
            child = placed.node.children[name]
            if child.count >= min_samples:
                todo.append(_Placed(child, x, placed.depth + 1))
            x += child.count


def _family(placed: _Placed) -> str:
    if placed.depth <= 1 or placed.node.name == TRUNCATED:
        return "root"
    return "kernel" if placed.node.kernel else "user"


def colour(name: str, family: str) -> str:
    """A colour of ``family`` that depends on ``name`` only, so graphs compare run to run."""
    digest = hashlib.blake2s(name.removesuffix(KERNEL_SUFFIX).encode(), digest_size=2).digest()
    share = int.from_bytes(digest, "big") / 0xFFFF
    base, span = PALETTES[family]
    r, g, b = (lo + int(extra * share) for lo, extra in zip(base, span, strict=True))
    return f"rgb({r},{g},{b})"


def label(name: str, px: float) -> str:
    """The text drawn in a frame ``px`` wide: the name, or its start and "..", or nothing."""
    fit = int((px - 3) // CHAR_WIDTH)
    if fit < 3:
        return ""
    return name if len(name) <= fit else name[: fit - 2] + ".."


def _xml(text: str) -> str:
    return html.escape(_NOT_XML.sub("\ufffd", text), quote=True)


def _frame(placed: _Placed, total: int, height: int) -> str:
    node = placed.node
    scale = (WIDTH - 2 * PAD) / total
    x = PAD + placed.x * scale
    px = node.count * scale
    y = height - BOTTOM - (placed.depth + 1) * FRAME_HEIGHT
    tip = f"{node.name} ({node.count} samples, {100 * node.count / total:.2f}%)"
    fill = colour(node.name, _family(placed))
    return (
        f'<g class="f" data-x="{placed.x}" data-w="{node.count}" data-d="{placed.depth}">'
        f"<title>{_xml(tip)}</title>"
        f'<rect x="{x:.2f}" y="{y}" width="{px:.2f}" height="{FRAME_HEIGHT - 1}" '
        f'fill="{fill}" rx="2"/>'
        f'<text x="{x + 3:.2f}" y="{y + FRAME_HEIGHT - 4.5}">{_xml(label(node.name, px))}</text>'
        "</g>"
    )


def _legend() -> list[str]:
    """A swatch per colour family, on a line of its own under the subtitle."""
    items = []
    for i, (family, text) in enumerate(LEGEND):
        x = PAD + i * 80
        items.append(f'<rect x="{x}" y="49" width="10" height="10" fill="{colour(text, family)}"/>')
        items.append(f'<text x="{x + 14}" y="58">{text}</text>')
    return items


def _chrome(profile: Profile, height: int) -> list[str]:
    """Title, subtitle, legend, the controls and the two status lines the script fills in."""
    return [
        '<rect width="100%" height="100%" fill="#f8f8f8"/>',
        f'<text id="title" x="{WIDTH / 2}" y="24" text-anchor="middle">'
        f"{_xml(title(profile))}</text>",
        f'<text id="subtitle" x="{WIDTH / 2}" y="42" text-anchor="middle">'
        f"{_xml(summary(profile))}</text>",
        f'<text id="reset" class="button hidden" x="{PAD}" y="24">Reset Zoom</text>',
        f'<text id="case" class="button" x="{WIDTH - PAD - 70}" y="24" text-anchor="end">'
        "Case: match</text>",
        f'<text id="search" class="button" x="{WIDTH - PAD}" y="24" text-anchor="end">'
        "Search</text>",
        f'<text id="details" x="{PAD}" y="{height - 12}"> </text>',
        f'<text id="matched" x="{WIDTH - PAD}" y="{height - 12}" text-anchor="end"></text>',
        *_legend(),
    ]


def render(profile: Profile, naming: Naming, min_width: float = MIN_WIDTH) -> str:
    root = _tree(profile, naming)
    total = root.count
    # Below min_width pixels a frame is invisible anyway; leaving it out keeps big graphs fast.
    min_samples = max(min_width * total / (WIDTH - 2 * PAD), 1)
    placed = sorted(_place(root, min_samples), key=lambda p: (p.depth, p.x)) if total else []
    depth = max((p.depth for p in placed), default=0)
    height = TOP + (depth + 1) * FRAME_HEIGHT + BOTTOM
    lines = [
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>',
        f'<svg version="1.1" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'xmlns="http://www.w3.org/2000/svg" data-total="{total}" data-pad="{PAD}" '
        f'data-char-width="{CHAR_WIDTH}">',
        f"<style>{STYLE}</style>",
        *_chrome(profile, height),
        '<g id="frames">',
        *(_frame(p, total, height) for p in placed),
        "</g>",
    ]
    if not total:
        lines.append(f'<text x="{WIDTH / 2}" y="{TOP + 12}" text-anchor="middle">No samples</text>')
    lines += [f"<script><![CDATA[{SCRIPT}]]></script>", "</svg>"]
    return "\n".join(lines) + "\n"
