"""docs/architecture.md's module list against the package (every module of qmpprof/ named on
the map, every module the map names there), and the docs/ pages README.md and docs/ name.

The map's "## The modules" section is a list of packages, one bullet each opening with the
package's folder in backquotes (`guest/linux/`, `qmpprof/` for the top level); every `NAME.py`
in a bullet is a module of that package. A package's ``__init__.py`` may be named (where it
holds a registry) and need not be.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qmpprof"
MAP = ROOT / "docs" / "architecture.md"
MAP_LINES = 150  # a one-page map (issue 32); depth goes to the modules' docstrings


def mapped_modules(text: str) -> list[str]:
    """The paths under qmpprof/ the map's module list names, in its order."""
    section = re.split(r"^## The modules\n", text, flags=re.M)[1].split("\n## ", 1)[0]
    named: list[str] = []
    for bullet in re.split(r"\n(?=- `)", section.strip()):
        folder = re.match(r"- `([\w/]+/)`", bullet)
        assert folder is not None, f"a bullet that names no package folder: {bullet[:60]!r}"
        prefix = "" if folder[1] == "qmpprof/" else folder[1]
        named += [prefix + name for name in re.findall(r"`(\w+\.py)`", bullet)]
    return named


def package_modules() -> set[str]:
    return {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}


def test_mapped_modules_reads_packages_and_their_modules() -> None:
    text = (
        "## The modules\n\n- `qmpprof/`: `errors.py` the tree; `Frame` a value;\n"
        "  `model.py` values.\n- `guest/linux/`: `guest.py` its life (`LinuxGuest`).\n\n"
        "## Next\n- `x/`: `y.py`\n"
    )
    assert mapped_modules(text) == ["errors.py", "model.py", "guest/linux/guest.py"]


def test_the_map_names_every_module_and_only_modules() -> None:
    named = mapped_modules(MAP.read_text())
    modules = package_modules()
    missing = sorted(m for m in modules - set(named) if not m.endswith("__init__.py"))
    extra = sorted(set(named) - modules)
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not missing, f"modules of qmpprof/ that docs/architecture.md does not name: {missing}"
    assert not extra, f"docs/architecture.md names modules qmpprof/ does not have: {extra}"
    assert not twice, f"docs/architecture.md names these modules twice: {twice}"


def test_the_map_is_one_page() -> None:
    lines = len(MAP.read_text().splitlines())
    assert lines <= MAP_LINES, f"docs/architecture.md has {lines} lines: the map is one page"


def test_every_docs_page_the_readme_and_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        (page.name, path)
        for page in pages
        for path in re.findall(r"docs/[\w./-]+\.(?:md|png|svg)", page.read_text())
    }
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).exists())
    assert not missing, f"pages named that are not there: {missing}"
