"""Differential profiles: BEFORE and AFTER compared stack by stack, in the naming asked for.

- Folded: ``stack COUNT_BEFORE COUNT_AFTER``, one line per stack of either profile, sorted, as
  FlameGraph's difffolded.pl writes it (flamegraph.pl and inferno draw it).
- SVG: frames laid out by AFTER, as flamegraph.pl does, each coloured by how its share of the
  samples changed: share in AFTER minus share in BEFORE, in percentage points, so the two
  totals are normalised (a run twice as long is not "all red"). Red grew, blue shrank, grey is
  unchanged; the colour deepens with the change up to full colour at the largest change, or at
  the noise when the largest is within it: a share is known to ``profile.share_margin`` points
  (95 %, the estimate qmpprof's summary warns with), a change of share to both profiles'
  margins combined, so a change smaller than that noise is never drawn full. The legend says
  where full colour starts and how pale the noise is. Tooltips give both counts, both shares
  and the change, and say when it is within the noise.

  flamegraph.pl draws a stack AFTER lacks with width 0: what went away cannot be seen, though it
  is often the point of the comparison (a function that no longer runs). Here such stacks are
  drawn beside AFTER's, on a base of their own, ``[only in before]``, as wide as their share of
  BEFORE (normalised to AFTER's total), in blue. Every frame of AFTER keeps its AFTER width; the
  graph is wider than AFTER by the share that went away.
"""

from __future__ import annotations

import math
from collections import Counter

import qmpprof.output.svg as svg
from qmpprof.naming import Naming
from qmpprof.profile import Profile, share_margin

GONE = "[only in before]"
UNCHANGED = "rgb(220,220,220)"

Stacks = Counter[tuple[str, ...]]


def union(
    before: Profile, after: Profile, naming: Naming
) -> dict[tuple[str, ...], tuple[int, int]]:
    """(samples in BEFORE, samples in AFTER) per named stack of either, root first."""
    old, new = before.named_counts(naming), after.named_counts(naming)
    return {names: (old[names], new[names]) for names in sorted(old.keys() | new.keys())}


def render_folded(before: Profile, after: Profile, naming: Naming) -> str:
    lines = (f"{';'.join(names)} {b} {a}" for names, (b, a) in union(before, after, naming).items())
    return "".join(line + "\n" for line in lines)


def tree(old: Stacks, new: Stacks) -> svg.Node:
    """The graph's frames: widths from AFTER, BEFORE-only stacks under ``GONE``.

    Widths are in units that make both profiles whole numbers: an AFTER sample is worth
    BEFORE's total, a BEFORE sample AFTER's total (so a BEFORE-only stack is as wide as its
    share of BEFORE would be in AFTER)."""
    total_old, total_new = sum(old.values()), sum(new.values())
    per_new, per_old = total_old or 1, total_new or 1
    root = svg.Node(svg.ROOT)
    for names, count in new.items():
        for node in (root, *root.add(names, count * per_new)):
            node.after += count
    gone = svg.Node(GONE)
    for names, count in old.items():
        root.before += count
        node = root
        for name in names:
            found = node.children.get(name)
            if found is None:
                break
            node = found
            node.before += count
        if not new[names]:
            for node in (gone, *gone.add(names, count * per_old)):
                node.before += count
    if gone.count:
        root.children[GONE] = gone
        root.count += gone.count
    return root


def render_svg(
    before: Profile, after: Profile, naming: Naming, names: tuple[str, str] = ("before", "after")
) -> str:
    old, new = before.named_counts(naming), after.named_counts(naming)
    root = tree(old, new)
    total_old, total_new = root.before, root.after
    noise = noise_points(total_old, total_new)
    full = max(_largest_change(root, total_old, total_new), noise)
    paint = _Painter(total_old, total_new, full, noise)
    subtitle = (
        f"widths: AFTER ({total_new} samples)  ·  colour: change of share from BEFORE "
        f"({total_old} samples), totals normalised: red grew, blue shrank"
    )
    if GONE in root.children:
        subtitle += f"  ·  {GONE}: stacks AFTER lacks, at their BEFORE share"
    heading = f"qmpprof diff: {names[0]} → {names[1]}"
    return svg.draw(root, heading, subtitle, paint, legend(full, noise))


def noise_points(total_old: int, total_new: int) -> float:
    """The 95 % margin of a change of share, in points: the margins of the two shares (each
    near one half, where it is widest), independent errors combined."""
    return math.hypot(share_margin(total_old), share_margin(total_new))


def legend(full: float, noise: float) -> list[tuple[str, str]]:
    """Where full colour starts, and the colour of a change as large as the noise."""
    return [
        (_fill(1.0), f"grew {full:.1f} points or more"),
        (_fill(-1.0), f"shrank {full:.1f} points or more"),
        (_fill(noise / full), f"this pale or paler: within the noise, ±{noise:.1f} points (95 %)"),
        (UNCHANGED, "unchanged"),
    ]


def _share(count: int, total: int) -> float:
    return 100 * count / total if total else 0.0


def _change(node: svg.Node, total_old: int, total_new: int) -> float:
    """Percentage points gained by the node's share, AFTER against BEFORE."""
    return _share(node.after, total_new) - _share(node.before, total_old)


def _largest_change(root: svg.Node, total_old: int, total_new: int) -> float:
    largest, todo = 0.0, [root]
    while todo:
        node = todo.pop()
        largest = max(largest, abs(_change(node, total_old, total_new)))
        todo += node.children.values()
    return largest


def _fill(strength: float) -> str:
    """Red for growth, blue for shrinking, paler as ``strength`` (-1..1) nears 0."""
    if strength == 0:
        return UNCHANGED
    pale = int(220 * (1 - min(abs(strength), 1.0)))
    return f"rgb(255,{pale},{pale})" if strength > 0 else f"rgb({pale},{pale},255)"


class _Painter:
    def __init__(self, total_old: int, total_new: int, full: float, noise: float) -> None:
        self.total_old, self.total_new = total_old, total_new
        self.full, self.noise = full, noise

    def __call__(self, placed: svg.Placed, total: int) -> tuple[str, str]:
        node = placed.node
        change = _change(node, self.total_old, self.total_new)
        within = ", within the noise" if change and abs(change) < self.noise else ""
        # "name (...)", the flame graph's tooltip shape: its script reads the name back from it.
        tip = (
            f"{node.name} (before {node.before}, {_share(node.before, self.total_old):.2f}%; "
            f"after {node.after}, {_share(node.after, self.total_new):.2f}%; "
            f"{change:+.2f} points{within})"
        )
        return _fill(change / self.full), tip


def changes(
    before: Profile, after: Profile, naming: Naming, n: int = 10
) -> list[tuple[str, int, int, float]]:
    """The leaf functions whose share of samples changed most: (name, before, after, points)."""
    old: Counter[str] = Counter()
    new: Counter[str] = Counter()
    for names, (b, a) in union(before, after, naming).items():
        old[names[-1]] += b
        new[names[-1]] += a
    total_old, total_new = sum(old.values()), sum(new.values())
    rows = [
        (name, old[name], new[name], _share(new[name], total_new) - _share(old[name], total_old))
        for name in old.keys() | new.keys()
    ]
    return sorted(rows, key=lambda r: (-abs(r[3]), r[0]))[:n]
