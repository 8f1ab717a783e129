"""``scripts/mutate``: break named things in qmpprof one at a time and show that a test fails for
each (issue 31's mutation check; see docs/mutate.md).

Each mutation in ``mutations.toml`` is one exact textual edit of one file (``old`` -> ``new``)
and the tests expected to catch it. The tree is copied once to a temporary directory; there each
edit is made, its tests run (pytest, stopping at the first failure), and the file put back. A
mutation whose ``old`` text is not in its file exactly once is stale (the code moved on): that
fails the run as a mutation no test catches does. The tests must pass on the unbroken copy first,
or a failure would prove nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = Path(__file__).with_name("mutations.toml")
TIMEOUT = 300  # seconds for one mutation's tests: a mutation that hangs them is no catch
# Not copied: history, the environment, downloads, what runs leave behind (.gitignore's), and
# the built guests (linked instead: large).
_AT_ROOT = shutil.ignore_patterns(
    ".git", ".venv", "build", "node_modules", ".bench", ".cache", "core", "demo.*"
)
_ANYWHERE = shutil.ignore_patterns(
    "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache", ".pytest_cache"
)
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Mutation:
    name: str
    file: str  # relative to the tree's root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids that should fail


@dataclass(frozen=True, slots=True)
class Verdict:
    mutation: Mutation
    caught_by: tuple[str, ...]  # the tests that failed; empty: not caught
    problem: str = ""  # stale, or the tests could not run: the mutation proves nothing

    @property
    def ok(self) -> bool:
        return bool(self.caught_by) and not self.problem

    def line(self, width: int) -> str:
        name = self.mutation.name.ljust(width)
        if self.problem:
            return f"{name}  {self.problem}"
        if not self.caught_by:
            return f"{name}  NOT CAUGHT (ran {', '.join(self.mutation.tests)})"
        return f"{name}  caught by {', '.join(self.caught_by)}"


def load(table: Path) -> list[Mutation]:
    """The mutations of a TOML table: ``[[mutation]]`` entries with name, file, old, new, tests."""
    data = tomllib.loads(table.read_text())
    return [
        Mutation(m["name"], m["file"], m["old"], m["new"], tuple(m["tests"]))
        for m in data["mutation"]
    ]


def copy_tree(root: Path, into: Path) -> Path:
    """A copy of the tree at ``root`` inside ``into``, its built fixtures linked, not copied."""
    tree = into / "tree"
    build = root / "fixtures" / "build"

    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = set(_ANYWHERE(folder, names))
        if Path(folder) == root:
            skipped |= _AT_ROOT(folder, names)
        if Path(folder) == build.parent:
            skipped.add(build.name)
        return skipped

    shutil.copytree(root, tree, symlinks=True, ignore=ignore)
    if build.exists():
        (tree / "fixtures" / "build").symlink_to(build.resolve())
    return tree


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, tuple[str, ...], str]:
    """pytest's exit code, the tests that failed and its output, on ``tree``'s own code."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "tests")]))
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(
            [*command, *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return -1, (), f"timed out after {TIMEOUT} s"
    out = done.stdout + done.stderr
    return done.returncode, tuple(dict.fromkeys(_FAILED.findall(out))), out


def stale(tree: Path, mutation: Mutation) -> str:
    """Why ``mutation`` cannot be made in ``tree`` (its file or its old text gone), or ""."""
    path = tree / mutation.file
    if not path.is_file():
        return f"STALE: {mutation.file} does not exist"
    found = path.read_text().count(mutation.old)
    return "" if found == 1 else f"STALE: its old text is in {mutation.file} {found} times"


def apply(tree: Path, mutation: Mutation) -> Verdict:
    """Make ``mutation`` (not stale) in ``tree``, run its tests, put the file back."""
    path = tree / mutation.file
    original = path.read_text()
    _write(path, original.replace(mutation.old, mutation.new))
    try:
        code, failed, out = run_tests(tree, mutation.tests)
    finally:
        _write(path, original)
    if code == 0:
        return Verdict(mutation, ())
    if code != 1 or not failed:  # collection errors, a hang, a test id that does not exist
        return Verdict(mutation, (), f"ERROR: pytest exit {code}: {_gist(out)}")
    return Verdict(mutation, failed)


def _write(path: Path, text: str) -> None:
    # A same-sized edit within the second would leave the compiled module looking current.
    Path(importlib.util.cache_from_source(str(path))).unlink(missing_ok=True)
    path.write_text(text)


def _gist(out: str) -> str:
    """pytest's first error line, else its last line."""
    lines = out.strip().splitlines() or ["no output"]
    return next((line for line in lines if line.startswith("ERROR")), lines[-1])


def check(root: Path, mutations: list[Mutation], report: Callable[[str], None] = print) -> bool:
    """Every mutation against a copy of ``root``, one line each; True when each was caught."""
    width = max(len(m.name) for m in mutations)
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="qmpprof-mutate-") as into:
        tree = copy_tree(root, Path(into))
        problems = {m.name: stale(tree, m) for m in mutations}
        every = tuple(dict.fromkeys(t for m in mutations if not problems[m.name] for t in m.tests))
        code, failed, out = run_tests(tree, every) if every else (0, (), "")
        if code != 0:
            report(f"the tests fail on the unbroken tree ({', '.join(failed) or _gist(out)})")
            return False
        for mutation in mutations:
            problem = problems[mutation.name]
            verdicts.append(Verdict(mutation, (), problem) if problem else apply(tree, mutation))
            report(verdicts[-1].line(width))
    caught = sum(v.ok for v in verdicts)
    report(f"{len(verdicts)} mutations: {caught} caught, {len(verdicts) - caught} not")
    return caught == len(verdicts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/mutate", description=__doc__)
    parser.add_argument("names", nargs="*", help="only these mutations (default: every one)")
    parser.add_argument("--table", type=Path, default=TABLE, help="the mutations' TOML file")
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to copy and mutate")
    args = parser.parse_args(argv)
    try:
        mutations = load(args.table)
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as err:
        parser.error(f"{args.table}: not a table of mutations ({type(err).__name__}: {err})")
    unknown = set(args.names) - {m.name for m in mutations}
    if unknown:
        parser.error(f"no mutation named {', '.join(sorted(unknown))}")
    chosen = [m for m in mutations if not args.names or m.name in args.names]
    start = time.monotonic()
    ok = check(args.root, chosen)
    print(f"({time.monotonic() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
