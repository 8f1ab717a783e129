"""Shared pytest fixtures, and the two tiers: tests/unit boots no QEMU, tests/e2e does. The bundled
guest: built once per session, booted per test. The Debian kernel of the linux tests: fetched
and unpacked once per session. The Linux guests shared by several files (``kaslr_linux``,
``churn_linux``): booted once per kernel series and session (``nokaslr_linux``: once), checked
after each test (tests/sharedlinux.py). The ``qemu`` marker: given to every test in tests/e2e
and by the fixtures a test uses, and checked against what the test boots (tests/qemumark.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import linuxkernel
import linuxvm
import pytest
import qemumark
import sharedlinux
from guestvm import Guest, build_fixtures, running_guest
from qemus import HOST, Qemu
from sharedlinux import Shared

from qmpprof.elf.image import ElfImage
from qmpprof.linux.bzimage import vmlinux_bytes

BEFORE_SETUP = pytest.StashKey[set[int]]()

# The two tiers, by folder: unit tests boot no QEMU, e2e tests do.
UNIT = Path(__file__).resolve().parent / "unit"
E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in tests/e2e, and every test using a fixture that boots QEMU, is a QEMU test;
    a QEMU test in tests/unit is refused, so the folder a test sits in says which tier runs it."""
    for item in items:
        if item.get_closest_marker("qemu") is None and (
            E2E in item.path.parents or qemumark.uses_booting_fixture(item)
        ):
            item.add_marker(pytest.mark.qemu)
    misplaced = [
        item.nodeid
        for item in items
        if UNIT in item.path.parents and item.get_closest_marker("qemu") is not None
    ]
    if misplaced:
        raise pytest.UsageError(f"QEMU tests in tests/unit (move them to tests/e2e): {misplaced}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    qemumark.marked = item.get_closest_marker("qemu") is not None
    item.stash[BEFORE_SETUP] = {pid for pid, _name in qemumark.qemu_descendants()}
    result = yield
    qemumark.check_unmarked(item, item.stash[BEFORE_SETUP], "after the setup")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    result = yield
    qemumark.check_unmarked(item, item.stash[BEFORE_SETUP], "at the end of the body")
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many times each boot helper booted QEMU in this session."""
    if qemumark.BOOTS:
        counts = ", ".join(f"{what} {n}" for what, n in sorted(qemumark.BOOTS.items()))
        terminalreporter.write_line(f"QEMU boots: {counts}")
    if (over := linuxvm.stale_int3_over_ceiling()) is not None:
        terminalreporter.write_line(f"FAILED: {over}", red=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Boots made again for a stale int3 (tests/linuxvm.py) past their ceiling fail the run."""
    if linuxvm.stale_int3_over_ceiling() is not None:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    result = yield
    qemumark.marked = True  # fixtures of a wider scope are torn down outside any test
    return result


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """qmpprof's cache (unpacked Linux kernels) in a folder of the test session's own, for
    the tests and the qmpprof processes they start, not in the user's ~/.cache."""
    saved = os.environ.get("QMPPROF_CACHE_DIR")
    os.environ["QMPPROF_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if saved is None:
        del os.environ["QMPPROF_CACHE_DIR"]
    else:
        os.environ["QMPPROF_CACHE_DIR"] = saved


@pytest.fixture(autouse=True)
def qemu_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Qemu:
    """The QEMU this test runs on (tests/qemus.py): the host's, or the one ``every_qemu``
    gives, whose folder then comes first on PATH for the test (and what it starts)."""
    qemu: Qemu = getattr(request, "param", HOST)
    if qemu is not HOST:
        if qemu.version is None:
            pytest.fail(qemu.missing())
        monkeypatch.setenv("PATH", qemu.path_env())
    return qemu


@pytest.fixture(scope="session")
def guest_build() -> None:
    """Both variants of fixtures/guest built (scripts/build-fixtures, once per session)."""
    build_fixtures()


@pytest.fixture
@qemumark.boots_qemu
def guest(tmp_path: Path, guest_build: None) -> Iterator[Guest]:
    """The cfi build on one vCPU, workload running; QEMU is killed afterwards."""
    with running_guest(tmp_path, "cfi", 1) as g:
        yield g


@pytest.fixture(scope="session")
def linux_dir() -> Path:
    """fixtures/build/linux: the Debian kernel from scripts/fetch-linux (run if needed)."""
    return linuxkernel.linux_dir()


@pytest.fixture(scope="session")
def linux_vmlinux(linux_dir: Path) -> ElfImage:
    """The vmlinux ELF unpacked from the Debian bzImage, once per session."""
    return linuxkernel.vmlinux()


@pytest.fixture(scope="session")
def linux_vmlinux_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Debian's 6.12 vmlinux ELF unpacked from its vmlinuz into a file (for pahole, bpftool)."""
    path = tmp_path_factory.mktemp("linux") / "vmlinux"
    path.write_bytes(vmlinux_bytes((linuxkernel.linux_dir() / "vmlinuz").read_bytes()))
    return path


@pytest.fixture(scope="session", params=linuxkernel.BOOTED)
@qemumark.boots_qemu
def kaslr_boot(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shared]:
    """The shared KASLR Linux guest of each series, its kallsyms dumped (tests/sharedlinux.py)."""
    tmp = tmp_path_factory.mktemp(f"kaslr-{request.param}")
    with sharedlinux.booted(tmp, sharedlinux.KASLR, request.param) as shared:
        yield shared


@pytest.fixture
def kaslr_linux(kaslr_boot: Shared) -> Iterator[Shared]:
    """The shared KASLR guest, running for this test and checked afterwards."""
    with sharedlinux.lent(kaslr_boot) as shared:
        yield shared


@pytest.fixture(scope="session")
@qemumark.boots_qemu
def nokaslr_boot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """The shared 6.12 Linux guest booted with nokaslr, its kallsyms dumped."""
    tmp = tmp_path_factory.mktemp("nokaslr")
    with sharedlinux.booted(tmp, sharedlinux.NOKASLR, "6.12") as shared:
        yield shared


@pytest.fixture
def nokaslr_linux(nokaslr_boot: Shared) -> Iterator[Shared]:
    """The shared nokaslr guest, running for this test and checked afterwards."""
    with sharedlinux.lent(nokaslr_boot) as shared:
        yield shared


@pytest.fixture(scope="session", params=linuxkernel.BOOTED)
@qemumark.boots_qemu
def churn_boot(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shared]:
    """The shared Linux guest of each series running the churn workload (``qmpprof.churn``)."""
    tmp = tmp_path_factory.mktemp(f"churn-{request.param}")
    with sharedlinux.booted(tmp, sharedlinux.CHURN_KIND, request.param) as shared:
        yield shared


@pytest.fixture
def churn_linux(churn_boot: Shared) -> Iterator[Shared]:
    """The shared churn guest, running for this test and checked afterwards."""
    with sharedlinux.lent(churn_boot) as shared:
        yield shared
