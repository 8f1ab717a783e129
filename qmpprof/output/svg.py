"""SVG flame graph: one self-contained, interactive file that opens in any browser.

Root at the bottom, as in flamegraph.pl: the base is ``all``, above it the context of each sample
(a process label or ``kernel``), then its frames from outermost to leaf. Siblings are merged by
name and ordered alphabetically, so the x axis is not time: width is the share of samples.
Frames narrower than ``min_width`` pixels are not drawn (their samples still count in every
ancestor). Colours come from a hash of the name, in three families: kernel code (orange, as
FlameGraph's ``_[k]``), user code (red) and the synthetic roots and contexts (aqua).

A profile holding tasks off CPU is drawn three times in the one file, each graph a view the
buttons switch between (``#v=cpu`` in the URL): ``wall`` (every sample: where each thread spends
wall time), ``on CPU`` and ``off CPU``; in these each process's threads stand apart, a frame
``comm (pid/tid)`` above the process's.

``draw`` lays out any tree of ``Node`` and takes a ``Paint`` (fill and tooltip per frame) and a
legend: the differential graph (output/diff.py) colours by change through it.
"""

from __future__ import annotations

import hashlib
import html
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from qmpprof.naming import (
    FIRMWARE_NAME,
    KERNEL_SUFFIX,
    TRUNCATED,
    USER_GONE,
    Naming,
    thread_name,
)
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
    "firmware": ((120, 120, 140), (40, 40, 40)),
}

LEGEND = (("kernel", "kernel"), ("user", "user"), ("root", "context"))
# (view, its button's text): the graphs of a profile with tasks off CPU, the first shown first.
VIEWS = (("wall", "wall"), ("cpu", "on CPU"), ("off", "off CPU"))

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
    context: bool = False  # a frame the writer adds (thread, state): coloured as the root

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


def _tree(
    profile: Profile,
    named: list[NamedStack],
    on_cpu: bool | None = None,
    threads: bool = False,
) -> Node:
    """The graph of the samples on a CPU (``on_cpu`` True), off it (False) or all, with a
    frame per thread under its process's when ``threads``."""
    root = Node(ROOT)
    # Real runs repeat the same few stacks thousands of times: walk each distinct one once.
    unique: Counter[tuple[NamedStack, int]] = Counter()
    for record, stack, count in zip(profile.stacks, named, profile.counts, strict=True):
        if not count or (on_cpu is not None and on_cpu != (record.state is None)):
            continue
        process, added = record.process, 0
        if threads and process is not None and process.tid is not None:
            names = (stack.names[0], thread_name(process), *stack.names[1:])
            stack, added = NamedStack(names, (False, *stack.kernel)), 1
        unique[stack, added + (record.state is not None)] += count
    for (stack, added), count in unique.items():
        for node in root.add(stack.names, count, stack.kernel)[1 : 1 + added]:
            node.context = True
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
    if placed.node.name.startswith(FIRMWARE_NAME):
        return "firmware"
    if placed.depth <= 1 or placed.node.context or placed.node.name in (TRUNCATED, USER_GONE):
        return "root"
    return "kernel" if placed.node.kernel else "user"


def colour(name: str, family: str) -> str:
    """A colour of ``family`` that depends on ``name`` only, so graphs compare run to run."""
    # "surrogatepass": a name from guest bytes may hold a lone surrogate, and still has a colour.
    plain = name.removesuffix(KERNEL_SUFFIX).encode("utf-8", "surrogatepass")
    digest = hashlib.blake2s(plain, digest_size=2).digest()
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
    items, x = [], PAD
    for fill, text in swatches:
        items.append(f'<rect x="{x}" y="49" width="10" height="10" fill="{fill}"/>')
        items.append(f'<text x="{x + 14}" y="58">{_xml(text)}</text>')
        # 80 pixels a swatch, more where its text is longer (the diff's say what colours mean).
        x += max(80, math.ceil(14 + len(text) * CHAR_WIDTH + 16))
    return items


def _switch(views: Sequence[str]) -> list[str]:
    """The buttons that choose a view, at the right end of the legend's line."""
    if len(views) < 2:
        return []
    x = WIDTH - PAD - 200
    items = [f'<text x="{x}" y="58">View:</text>']
    for (view, text), offset in zip(VIEWS, (45, 85, 145), strict=True):
        items.append(f'<text class="button view" data-view="{view}" x="{x + offset}" y="58">'
                     f"{text}</text>")  # fmt: skip
    return items


def _chrome(
    heading: str,
    subtitle: str,
    swatches: Iterable[tuple[str, str]],
    height: int,
    views: Sequence[str] = (),
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
        *_switch(views),
    ]


def render(profile: Profile, naming: Naming, min_width: float = MIN_WIDTH) -> str:
    named = profile.named(naming)
    # The firmware's swatch only where it ran: most profiles never see it.
    firmware = any(n.names[0].startswith(FIRMWARE_NAME) for n in named)
    legend = (*LEGEND, ("firmware", "firmware")) if firmware else LEGEND
    swatches = [(colour(text, family), text) for family, text in legend]
    if all(record.state is None for record in profile.stacks):
        views = [("", _tree(profile, named))]
    else:
        views = [(view, _tree(profile, named, on_cpu, threads=True))
                 for (view, _), on_cpu in zip(VIEWS, (None, True, False), strict=True)]  # fmt: skip
    heading, subtitle = title(profile), summary(profile)
    return draw_views(views, heading, subtitle, paint_by_family, swatches, min_width)


def draw(
    root: Node,
    heading: str,
    subtitle: str,
    paint: Paint,
    swatches: Iterable[tuple[str, str]],
    min_width: float = MIN_WIDTH,
) -> str:
    """The SVG of a tree whose base is ``root``: frames as wide as their count."""
    return draw_views([("", root)], heading, subtitle, paint, swatches, min_width)


def _placed(root: Node, min_width: float) -> list[Placed]:
    total = root.count
    # Below min_width pixels a frame is invisible anyway; leaving it out keeps big graphs fast.
    min_samples = max(min_width * total / (WIDTH - 2 * PAD), 1)
    return sorted(_place(root, min_samples), key=lambda p: (p.depth, p.x)) if total else []


def draw_views(
    views: Sequence[tuple[str, Node]],
    heading: str,
    subtitle: str,
    paint: Paint,
    swatches: Iterable[tuple[str, str]],
    min_width: float = MIN_WIDTH,
) -> str:
    """The SVG of one graph per (view, root), the first shown (one alone: no view switch)."""
    placed = [_placed(root, min_width) for _view, root in views]
    depth = max((p.depth for graph in placed for p in graph), default=0)
    height = TOP + (depth + 1) * FRAME_HEIGHT + BOTTOM
    total = views[0][1].count
    frames: list[str] = []
    for i, ((view, root), graph) in enumerate(zip(views, placed, strict=True)):
        if len(views) > 1:
            hidden = " hidden" if i else ""
            frames.append(f'<g class="view{hidden}" data-view="{view}" data-total="{root.count}">')
        frames += (_frame(p, root.count, height, paint) for p in graph)
        frames += ["</g>"] if len(views) > 1 else []
    lines = [
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>',
        f'<svg version="1.1" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'xmlns="http://www.w3.org/2000/svg" data-total="{total}" data-pad="{PAD}" '
        f'data-char-width="{CHAR_WIDTH}">',
        f"<style>{STYLE}</style>",
        *_chrome(heading, subtitle, swatches, height, [view for view, _root in views]),
        '<g id="frames">',
        *frames,
        "</g>",
    ]
    if not total:
        lines.append(f'<text x="{WIDTH / 2}" y="{TOP + 12}" text-anchor="middle">No samples</text>')
    lines += [f"<script><![CDATA[{SCRIPT}]]></script>", "</svg>"]
    return "\n".join(lines) + "\n"
