"""The exit codes README documents (its ### Exit codes table), for the tests that hold the
command, its --help and its error classes to them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def documented_codes() -> set[int]:
    """The exit codes of README's table (### Exit codes)."""
    section = README.read_text().split("### Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(code) for code in re.findall(r"^\| (\d+) \|", section, re.MULTILINE)}
