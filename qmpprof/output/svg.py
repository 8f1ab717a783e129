"""SVG flame graph: one self-contained, interactive file that opens in any browser.

Root at the bottom, as in flamegraph.pl: the base is ``all``, above it the context of each sample
(a process label or ``kernel``), then its frames from outermost to leaf. Siblings are merged by
name and ordered alphabetically, so the x axis is not time: width is the share of samples.
Frames narrower than ``min_width`` pixels are not drawn (their samples still count in every
ancestor). Colours come from a hash of the name, in three families: kernel code (orange, as
FlameGraph's ``_[k]``), user code (red) and the synthetic roots and contexts (aqua).

``draw`` lays out any tree of ``Node`` and takes a ``Paint`` (fill and tooltip per frame) and a
legend: the differential graph (output/diff.py) colours by change through it.
"""

from __future__ import annotations

import hashlib
import html
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from qmpprof.naming import KERNEL_SUFFIX, TRUNCATED, USER_GONE, Naming
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
class Node:
    """A frame of the graph: ``count`` is its width (samples); ``before`` and ``after`` are the
    two profiles' samples in a differential graph."""

    name: str
    kernel: bool = False
    count: int = 0
    children: dict[str, Node] = field(default_factory=dict)
    before: int = 0
    after: int = 0

    def add(self, names: Sequence[str], count: int, kernel: Sequence[bool] = ()) -> list[Node]:
        """Add ``count`` to this node and the path ``names`` under it; the path's nodes."""
        self.count += count
        node, path = self, []
        for i, name in enumerate(names):
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = Node(name)
            node = child
            node.count += count
            flag = kernel[i] if i < len(kernel) else False
            node.kernel = node.kernel or flag or name.endswith(KERNEL_SUFFIX)
            path.append(node)
        return path


@dataclass(frozen=True, slots=True)
class Placed:
    node: Node
    x: int  # samples to the left of the frame
    depth: int  # 0 is the ``all`` base


# fill colour and tooltip of a placed frame, given the graph's total width in samples
Paint = Callable[[Placed, int], tuple[str, str]]


def _tree(profile: Profile, naming: Naming) -> Node:
    root = Node(ROOT)
    # Real runs repeat the same few stacks thousands of times: walk each distinct one once.
    unique: Counter[NamedStack] = Counter()
    for named, count in zip(profile.named(naming), profile.counts, strict=True):
        if count:
            unique[named] += count
    for named, count in unique.items():
        root.add(named.names, count, named.kernel)
    return root


def _place(root: Node, min_samples: float) -> Iterator[Placed]:
    # Iterative: a kernel stack can be deeper than Python's recursion limit likes.
    todo = [Placed(root, 0, 0)]
    while todo:
        placed = todo.pop()
        yield placed
        x = placed.x
        for name in sorted(placed.node.children):
            child = placed.node.children[name]
            if child.count >= min_samples:
                todo.append(Placed(child, x, placed.depth + 1))
            x += child.count


def _family(placed: Placed) -> str:
    if placed.depth <= 1 or placed.node.name in (TRUNCATED, USER_GONE):
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


def paint_by_family(placed: Placed, total: int) -> tuple[str, str]:
    """The plain graph's paint: kernel, user or context colours, samples and share."""
    node = placed.node
    tip = f"{node.name} ({node.count} samples, {100 * node.count / total:.2f}%)"
    return colour(node.name, _family(placed)), tip


def _frame(placed: Placed, total: int, height: int, paint: Paint) -> str:
    node = placed.node
    scale = (WIDTH - 2 * PAD) / total
    x = PAD + placed.x * scale
    px = node.count * scale
    y = height - BOTTOM - (placed.depth + 1) * FRAME_HEIGHT
    fill, tip = paint(placed, total)
    return (
        f'<g class="f" data-x="{placed.x}" data-w="{node.count}" data-d="{placed.depth}">'
        f"<title>{_xml(tip)}</title>"
        f'<rect x="{x:.2f}" y="{y}" width="{px:.2f}" height="{FRAME_HEIGHT - 1}" '
        f'fill="{fill}" rx="2"/>'
        f'<text x="{x + 3:.2f}" y="{y + FRAME_HEIGHT - 4.5}">{_xml(label(node.name, px))}</text>'
        "</g>"
    )


def _legend(swatches: Iterable[tuple[str, str]]) -> list[str]:
    """A swatch per (fill, text), on a line of its own under the subtitle."""
    items = []
    for i, (fill, text) in enumerate(swatches):
        x = PAD + i * 80
        items.append(f'<rect x="{x}" y="49" width="10" height="10" fill="{fill}"/>')
        items.append(f'<text x="{x + 14}" y="58">{text}</text>')
    return items


def _chrome(
    heading: str, subtitle: str, swatches: Iterable[tuple[str, str]], height: int
) -> list[str]:
    """Title, subtitle, legend, the controls and the two status lines the script fills in."""
    return [
        '<rect width="100%" height="100%" fill="#f8f8f8"/>',
        f'<text id="title" x="{WIDTH / 2}" y="24" text-anchor="middle">{_xml(heading)}</text>',
        f'<text id="subtitle" x="{WIDTH / 2}" y="42" text-anchor="middle">{_xml(subtitle)}</text>',
        f'<text id="reset" class="button hidden" x="{PAD}" y="24">Reset Zoom</text>',
        f'<text id="case" class="button" x="{WIDTH - PAD - 70}" y="24" text-anchor="end">'
        "Case: match</text>",
        f'<text id="search" class="button" x="{WIDTH - PAD}" y="24" text-anchor="end">'
        "Search</text>",
        f'<text id="details" x="{PAD}" y="{height - 12}"> </text>',
        f'<text id="matched" x="{WIDTH - PAD}" y="{height - 12}" text-anchor="end"></text>',
        *_legend(swatches),
    ]


def render(profile: Profile, naming: Naming, min_width: float = MIN_WIDTH) -> str:
    swatches = [(colour(text, family), text) for family, text in LEGEND]
    root = _tree(profile, naming)
    return draw(root, title(profile), summary(profile), paint_by_family, swatches, min_width)


def draw(
    root: Node,
    heading: str,
    subtitle: str,
    paint: Paint,
    swatches: Iterable[tuple[str, str]],
    min_width: float = MIN_WIDTH,
) -> str:
    """The SVG of a tree whose base is ``root``: frames as wide as their count."""
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
        *_chrome(heading, subtitle, swatches, height),
        '<g id="frames">',
        *(_frame(p, total, height, paint) for p in placed),
        "</g>",
    ]
    if not total:
        lines.append(f'<text x="{WIDTH / 2}" y="{TOP + 12}" text-anchor="middle">No samples</text>')
    lines += [f"<script><![CDATA[{SCRIPT}]]></script>", "</svg>"]
    return "\n".join(lines) + "\n"
