"""The package's imports against the layering rules declared in docs/layering.md.

The rules are read from the ```layering block of that page, so the page and the check cannot
drift apart. Imports are read with ast (top-level and inside functions alike), never executed.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qmpprof"
DOC = ROOT / "docs" / "layering.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, name: str) -> set[str]:
    """Every module ``source`` imports (``from x import y`` counts x and x.y)."""
    package = name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@cache
def graph() -> dict[str, set[str]]:
    """Module -> what it imports (qmpprof modules that exist, and third-party top names)."""
    sources = {module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    out: dict[str, set[str]] = {}
    for name, source in sources.items():
        edges = set()
        for target in imports_of(source, name):
            if target.split(".")[0] == "qmpprof":
                if target in sources:
                    edges.add(target)
            else:
                edges.add(target)
        out[name] = edges
    return out


def within(name: str, prefix: str) -> bool:
    """``name`` is ``prefix`` or inside it; the package root stands for itself alone."""
    return name == prefix or (prefix != "qmpprof" and name.startswith(prefix + "."))


def reach(start: str) -> dict[str, str]:
    """Everything ``start`` imports directly or through qmpprof modules: target -> one path."""
    g = graph()
    seen: dict[str, str] = {}
    todo = [(start, start)]
    while todo:
        node, path = todo.pop()
        for target in g.get(node, ()):
            if target not in seen:
                seen[target] = f"{path} -> {target}"
                todo.append((target, seen[target]))
    return seen


def spares(name: str, pattern: str) -> bool:
    """``name`` is within ``pattern``, whose ``*`` stands for one module name at any depth
    (``qmpprof.linux.*.running``: each instruction set's running part)."""
    return within(name, pattern) or any(
        fnmatch.fnmatchcase(name, f) for f in (pattern, pattern + ".*")
    )


def rules() -> list[str]:
    found = re.search(r"```layering\n(.*?)```", DOC.read_text(), re.S)
    assert found is not None, f"{DOC} has no ```layering block"
    return [line.strip() for line in found[1].splitlines() if line.strip()]


def names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",")]


def breaches(rule: str) -> list[str]:
    g = graph()
    if m := re.fullmatch(r"nothing but (.+) imports from (\S+) other than (.+)", rule):
        allowed, family, kept = names(m[1]), m[2], names(m[3])
        return [
            f"{mod} imports {t}"
            for mod, edges in g.items()
            if not any(within(mod, a) for a in allowed)
            for t in edges
            if within(t, family) and t not in kept
        ]
    if m := re.fullmatch(r"nothing but (.+) imports (\S+)", rule):
        allowed, target = names(m[1]), m[2]
        return [
            f"{mod} imports {t}"
            for mod, edges in g.items()
            if not any(within(mod, a) for a in allowed)
            for t in edges
            if within(t, target)
        ]
    if m := re.fullmatch(r"(\S+)(?: but (.+?))? does not import (.+)", rule):
        owner, spared, banned = m[1], names(m[2]) if m[2] else [], names(m[3])
        out = []
        owned = (n for n in g if within(n, owner) and not any(spares(n, s) for s in spared))
        for mod in owned:
            for target, path in reach(mod).items():
                if any(within(target, b) for b in banned):
                    out.append(path)
        return out
    if m := re.fullmatch(r"(.+) imports? from (\S+) only (.+)", rule):
        owners, family, allowed = names(m[1]), m[2], names(m[3])
        return [
            f"{mod} imports {t}"
            for mod, edges in g.items()
            if any(within(mod, o) for o in owners)
            for t in edges
            if within(t, family) and t not in allowed
        ]
    if m := re.fullmatch(r"(\S+) imports only (.+)", rule):
        owner, allowed = m[1], names(m[2])
        return [
            f"{mod} imports {t}"
            for mod, edges in g.items()
            if within(mod, owner)
            for t in edges
            if t.split(".")[0] == "qmpprof" and not any(within(t, a) for a in allowed)
        ]
    if m := re.fullmatch(r"(\S+) only in (.+)", rule):
        library, homes = m[1], names(m[2])
        return [
            f"{mod} imports {t}"
            for mod, edges in g.items()
            if not any(within(mod, h) for h in homes)
            for t in edges
            if within(t, library)
        ]
    raise AssertionError(f"not a layering rule: {rule!r}")


@pytest.mark.parametrize("rule", rules())
def test_layering_rule_holds(rule: str) -> None:
    found = breaches(rule)
    assert not found, f"{rule}:\n  " + "\n  ".join(sorted(found))


def test_the_check_sees_a_breach() -> None:
    """The rules bite: a module of unwind importing the transport is found, also indirectly."""
    g = graph()
    g["qmpprof.unwind.chain"].add("qmpprof.memory")
    try:
        found = breaches("qmpprof.unwind does not import qmpprof.transport")
    finally:
        g["qmpprof.unwind.chain"].discard("qmpprof.memory")
    assert any("qmpprof.memory -> qmpprof.transport" in path for path in found)
    assert imports_of("from . import steps", "qmpprof.unwind.chain") >= {"qmpprof.unwind"}


def test_a_module_named_by_a_seam_s_users_is_a_breach() -> None:
    """Session naming a guest OS (or the sampler an instruction set) directly breaks its rule;
    through the registry it does not."""
    g = graph()
    rule = (
        "qmpprof.session import from qmpprof.guest"
        " only qmpprof.guest, qmpprof.guest.registry, qmpprof.guest.base"
    )
    assert not breaches(rule)
    g["qmpprof.session"].add("qmpprof.guest.emerald")
    try:
        assert breaches(rule) == ["qmpprof.session imports qmpprof.guest.emerald"]
    finally:
        g["qmpprof.session"].discard("qmpprof.guest.emerald")
    g["qmpprof.sampler"].add("qmpprof.arch.x86")
    try:
        found = breaches("qmpprof.sampler imports from qmpprof.arch only qmpprof.arch.base")
    finally:
        g["qmpprof.sampler"].discard("qmpprof.arch.x86")
    assert found == ["qmpprof.sampler imports qmpprof.arch.x86"]


def test_an_instruction_set_named_outside_its_platform_is_a_breach() -> None:
    """The running guest naming arm64's platform module, or an instruction set's code reader,
    directly breaks the rules; through the platform registry it does not."""
    g = graph()
    platform = "nothing but qmpprof.linux.aarch64, qmpprof.linux.platforms,"
    platform += " qmpprof.linux.running.platforms imports qmpprof.linux.aarch64"
    concrete = "nothing but qmpprof.arch, qmpprof.linux.x86_64, qmpprof.linux.aarch64,"
    concrete += " qmpprof.linux.riscv64"
    concrete += " imports from qmpprof.arch other than qmpprof.arch, qmpprof.arch.base"
    assert not breaches(platform) and not breaches(concrete)
    added = ("qmpprof.linux.aarch64.vectors", "qmpprof.arch.aarch64code")
    g["qmpprof.linux.running.guest"].update(added)
    try:
        found = breaches(platform) + breaches(concrete)
    finally:
        g["qmpprof.linux.running.guest"].difference_update(added)
    assert found == [f"qmpprof.linux.running.guest imports {t}" for t in added]


def cycles(within_prefix: str | None) -> list[list[str]]:
    """The import cycles among the modules within ``within_prefix`` (None: every qmpprof module;
    Tarjan's strongly connected components of more than one module, or a module importing
    itself)."""

    def inside(name: str) -> bool:
        if within_prefix is None:
            return name.split(".")[0] == "qmpprof"
        return within(name, within_prefix)

    g = {m: {t for t in e if inside(t)} for m, e in graph().items()}
    g = {m: e for m, e in g.items() if inside(m)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in g.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(part) > 1 or node in g.get(node, ()):
                found.append(sorted(part))

    for node in sorted(g):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_anywhere() -> None:
    """No cycle in the whole import graph (a package's ``from pkg import sibling`` inside it
    counts: it runs the package's own ``__init__``)."""
    assert cycles(None) == []


def test_the_cycle_check_sees_a_cycle() -> None:
    g = graph()
    g["qmpprof.unwind.steps"].add("qmpprof.unwind.scan")
    try:
        found = cycles("qmpprof.unwind")
    finally:
        g["qmpprof.unwind.steps"].discard("qmpprof.unwind.scan")
    assert found == [["qmpprof.unwind.scan", "qmpprof.unwind.steps"]]


def test_every_module_is_seen() -> None:
    assert {"qmpprof.sampler", "qmpprof.unwind.chain", "qmpprof.cli"} <= set(graph())


def transport_classes() -> set[str]:
    """The classes the modules of qmpprof.transport define."""
    return {
        node.name
        for path in (PACKAGE / "transport").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }


def transport_isinstances(source: str, classes: set[str]) -> list[str]:
    """Each ``isinstance`` (or ``issubclass``) call in ``source`` that names one of ``classes``
    (bare, as an attribute, or in a tuple), as "line: name"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            continue
        kinds = node.args[1]
        for named in kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]:
            name = named.attr if isinstance(named, ast.Attribute) else getattr(named, "id", "")
            if name in classes:
                found.append(f"{node.lineno}: {name}")
    return found


def test_no_transport_isinstance_outside_transport() -> None:
    """Which transport a run has is the registry's business: nothing outside transport/ asks
    what class its transport is."""
    classes = transport_classes()
    assert {"QmpTransport", "PrivateGdbTransport", "GdbTransport"} <= classes
    found = [
        f"{path.relative_to(ROOT)}:{hit}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not within(module_name(path), "qmpprof.transport")
        for hit in transport_isinstances(path.read_text(), classes)
    ]
    assert not found, "isinstance on a transport outside transport/:\n  " + "\n  ".join(found)


def test_the_isinstance_check_sees_one() -> None:
    classes = {"QmpTransport", "PrivateGdbTransport"}
    source = (
        "if isinstance(t, QmpTransport): pass\n"
        "ok = isinstance(t, (int, privategdb.PrivateGdbTransport))\n"
        "fine = isinstance(t, Registers)\n"
    )
    assert transport_isinstances(source, classes) == ["1: QmpTransport", "2: PrivateGdbTransport"]


def test_session_naming_a_concrete_transport_is_a_breach() -> None:
    g = graph()
    rule = next(r for r in rules() if r.startswith("qmpprof.session, qmpprof.cli, qmpprof.serve"))
    assert not breaches(rule)
    g["qmpprof.session"].add("qmpprof.transport.qmp")
    try:
        assert breaches(rule) == ["qmpprof.session imports qmpprof.transport.qmp"]
    finally:
        g["qmpprof.session"].discard("qmpprof.transport.qmp")


def tier_breaches(sources: dict[str, str], banned: set[str]) -> list[str]:
    """The imports of a module among ``banned`` by the modules of ``sources`` (module name ->
    its source)."""
    return sorted(
        f"{name} imports {target}"
        for name, source in sources.items()
        for target in imports_of(source, name)
        if target in banned
    )


def sources_of(paths: list[Path]) -> dict[str, str]:
    return {path.stem: path.read_text() for path in sorted(paths)}


def test_no_unit_test_or_helper_imports_an_e2e_module() -> None:
    """The unit tier is tests/unit with the helpers in tests/: if one of them imported a module
    of tests/e2e, running tests/unit alone would fail or drag a QEMU test's code in."""
    tests = ROOT / "tests"
    e2e = {path.stem for path in (tests / "e2e").glob("*.py")}
    sources = sources_of([*tests.glob("*.py"), *(tests / "unit").glob("*.py")])
    assert "test_guest_boot" in e2e and "guestvm" in sources and "test_guest" in sources
    assert not tier_breaches(sources, e2e)


def test_no_e2e_test_or_helper_imports_a_unit_test_module() -> None:
    """What both tiers use lives in a helper module of tests/ (the only folder on pytest's
    pythonpath): an e2e test importing a unit test module finds it only when pytest collected
    tests/unit in the same run."""
    tests = ROOT / "tests"
    unit = {path.stem for path in (tests / "unit").glob("test_*.py")}
    sources = sources_of([*tests.glob("*.py"), *(tests / "e2e").glob("*.py")])
    assert "test_guest" in unit and "test_guest_boot" in sources and "guestvm" in sources
    assert not tier_breaches(sources, unit)


def test_the_tier_check_sees_a_breach() -> None:
    sources = {"test_a": "import os\nfrom test_b_guest import helper\n", "test_c": "import d\n"}
    assert tier_breaches(sources, {"test_b_guest"}) == ["test_a imports test_b_guest"]
    e2e = {"test_x_e2e": "def f() -> None:\n    from test_serve import get\n"}
    assert tier_breaches(e2e, {"test_serve"}) == ["test_x_e2e imports test_serve"]
