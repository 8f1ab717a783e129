"""Folded stacks: one line per unique stack, ``root;...;leaf COUNT``, sorted for clean diffs."""

from __future__ import annotations

from qmpprof.naming import Naming
from qmpprof.profile import Profile


def render(profile: Profile, naming: Naming) -> str:
    counts = profile.named_counts(naming)
    lines = sorted(f"{';'.join(names)} {count}" for names, count in counts.items())
    return "".join(line + "\n" for line in lines)


def parse(text: str) -> list[tuple[tuple[str, ...], int]]:
    """Read folded text back: (frames root first, count) per line; countless lines are skipped."""
    stacks: list[tuple[tuple[str, ...], int]] = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks.append((tuple(stack.split(";")), int(count)))
    return stacks
