"""scripts/mutate on a small tree made here (a caught, an uncaught and two stale mutations, tests
that fail unbroken), and its own table checked against today's code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import mutate

CODE = """
def add(a, b):
    return a + b


def twice(x):
    return 2 * x
"""
TEST = """
from calc import add


def test_add():
    assert add(2, 3) == 5
"""
PYPROJECT = '[tool.pytest.ini_options]\nasyncio_default_fixture_loop_scope = "function"\n'


def _mutation(name: str, file: str, old: str, new: str) -> str:
    return (
        f'[[mutation]]\nname = "{name}"\nfile = "{file}"\nold = "{old}"\nnew = "{new}"\n'
        'tests = ["tests/test_calc.py::test_add"]\n'
    )


CAUGHT = _mutation("add-subtracts", "calc.py", "a + b", "a - b")
UNTESTED = _mutation("twice-thrice", "calc.py", "2 * x", "3 * x")
MOVED = _mutation("add-moved", "calc.py", "a += b", "a -= b")
GONE = _mutation("file-gone", "sums.py", "a + b", "a - b")
UNIMPORTABLE = _mutation("add-unparsed", "calc.py", "a + b", "a +")


def _tree(tmp_path: Path, table: str, test: str = TEST) -> list[str]:
    root = tmp_path / "root"
    (root / "tests").mkdir(parents=True)
    (root / "calc.py").write_text(CODE)
    (root / "tests" / "test_calc.py").write_text(test)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "table.toml").write_text(table)
    return ["--root", str(root), "--table", str(tmp_path / "table.toml")]


def test_each_mutation_is_reported_and_any_uncaught_or_stale_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _tree(tmp_path, "\n".join([CAUGHT, UNTESTED, MOVED, GONE, UNIMPORTABLE]))
    assert mutate.main(args) == 1
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"add-unparsed   ERROR: pytest exit [2-4]: ERROR tests/test_calc.py.*", lines[4]
    )
    assert lines[:4] + lines[5:6] == [
        "add-subtracts  caught by tests/test_calc.py::test_add",
        "twice-thrice   NOT CAUGHT (ran tests/test_calc.py::test_add)",
        "add-moved      STALE: its old text is in calc.py 0 times",
        "file-gone      STALE: sums.py does not exist",
        "5 mutations: 1 caught, 4 not",
    ]
    # The tree mutated was a copy: the original is as it was.
    assert (tmp_path / "root" / "calc.py").read_text() == CODE


def test_a_stale_mutation_alone_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mutate.main(_tree(tmp_path, MOVED)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "add-moved  STALE: its old text is in calc.py 0 times",
        "1 mutations: 0 caught, 1 not",
    ]


def test_a_table_that_is_not_one_is_said_so(tmp_path: Path) -> None:
    args = _tree(tmp_path, CAUGHT.replace("tests =", "test ="))
    with pytest.raises(SystemExit) as exit_:
        mutate.main(args)
    assert exit_.value.code == 2


def test_tests_that_fail_unbroken_prove_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = TEST.replace("== 5", "== 6")
    assert mutate.main(_tree(tmp_path, CAUGHT, broken)) == 1
    out = capsys.readouterr().out
    assert "the tests fail on the unbroken tree (tests/test_calc.py::test_add" in out
    assert "caught" not in out


def test_every_mutation_of_the_table_finds_its_text_once_and_names_tests_that_exist() -> None:
    mutations = mutate.load(mutate.TABLE)
    assert len({m.name for m in mutations}) == len(mutations) >= 12
    for m in mutations:
        assert (mutate.ROOT / m.file).read_text().count(m.old) == 1, m.name
        for test in m.tests:
            file, _, name = test.partition("::")
            assert f"def {name}(" in (mutate.ROOT / file).read_text(), test
