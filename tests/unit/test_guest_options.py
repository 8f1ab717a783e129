"""Each guest OS owns its options (guest.base.GuestOption): a toy OS registered here, and
nothing else touched, gets its flags on the profiling command and serve, its keys in serve's
TOML files, its file checked before a run, and its values handed to its own ``load`` as given;
a choosing option makes ``--os auto`` the toy and another ``--os`` refuse it. The real OSes'
options (--kallsyms, --metadata-addr, --metadata-layout, --describe) go the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from qmpprof import session
from qmpprof.cli import options, serve
from qmpprof.errors import UsageError
from qmpprof.guest import registry
from qmpprof.guest.base import Guest, GuestOption, GuestSpec, KernelFile
from qmpprof.serve.config import settings
from qmpprof.transport import BootFiles
from qmpprof.transport.base import Reach


class ToyOs:
    name = "toy"
    options = (
        GuestOption("toy_depth", "N", "how deep the toy looks", kind="value", read=int),
        GuestOption("toy_map", "FILE", "the toy's map", chooses=True),
    )

    def __init__(self) -> None:
        self.given: list[dict[str, object]] = []

    def recognises(self, kernel: KernelFile | None) -> bool:
        return False

    def load(self, spec: GuestSpec) -> Guest:
        self.given.append(dict(spec.options))
        raise UsageError("the toy loads nothing")


@pytest.fixture
def toy() -> Iterator[ToyOs]:
    made = ToyOs()
    registry.register(made)
    try:
        yield made
    finally:
        registry.unregister(made.name)


def test_a_guest_os_option_is_a_flag_of_the_command_and_of_serve(toy: ToyOs) -> None:
    assert "--toy-depth N" in options.parser().format_help()
    assert "--toy-map FILE" in serve.parser().format_help()
    ns = options.parser().parse_args(["--qmp-socket", "s", "--toy-depth", "3", "--toy-map", "m"])
    assert options.os_options_of(ns) == (("toy_depth", 3), ("toy_map", Path("m")))
    assert dict(serve.parse(["--qmp-socket", "s", "--toy-depth", "4"]).spec.os_options) == {
        "toy_depth": 4
    }


def test_a_bad_value_is_one_line_naming_the_flag(toy: ToyOs) -> None:
    with pytest.raises(UsageError, match=r"^--toy-depth: invalid literal for int"):
        options.parse(["--qmp-socket", "s", "--toy-depth", "deep"])
    with pytest.raises(UsageError, match=r"^--metadata-addr: not an address: 'x'$"):
        options.parse(["--qmp-socket", "s", "--metadata-addr", "x"])


def test_a_file_option_is_checked_before_the_run(toy: ToyOs, tmp_path: Path) -> None:
    missing = tmp_path / "nothing"
    spec = session.RunSpec(os_options=(("toy_map", missing),))
    with pytest.raises(UsageError, match=f"^--toy-map {missing}: no such file or directory$"):
        options.check_files(spec)
    with pytest.raises(UsageError, match=r"^--toy-map .*: a directory$"):
        options.check_files(session.RunSpec(os_options=(("toy_map", tmp_path),)))


def test_a_guest_os_option_is_a_key_of_serves_files(toy: ToyOs, tmp_path: Path) -> None:
    table = {"toy_depth": 5, "toy_map": "maps/toy.map", "kallsyms": "/boot/System.map"}
    found = settings(table, "vm.a.", tmp_path, socket=False)
    spec = found.apply(session.RunSpec(os_options=(("toy_depth", 1), ("metadata_addr", 8))))
    assert dict(spec.os_options) == {
        "toy_depth": 5,  # the file's over the flags'
        "metadata_addr": 8,  # the flags' where the file says nothing
        "toy_map": tmp_path / "maps/toy.map",  # from the file's folder
        "kallsyms": Path("/boot/System.map"),
    }
    with pytest.raises(UsageError, match=r"^vm\.a\.toy_depth: invalid literal for int"):
        settings({"toy_depth": "deep"}, "vm.a.", tmp_path, socket=False)


def test_the_values_reach_the_guest_os_as_given(toy: ToyOs, tmp_path: Path) -> None:
    spec = session.RunSpec(os_options=(("toy_depth", 2), ("toy_map", tmp_path)))
    with pytest.raises(UsageError, match="the toy loads nothing"):
        session.load(spec)  # --os auto: the toy, by its choosing option
    assert toy.given == [{"toy_depth": 2, "toy_map": tmp_path}]


def test_a_choosing_option_refuses_another_os(toy: ToyOs, tmp_path: Path) -> None:
    spec = session.RunSpec(os="cr3", os_options=(("toy_map", tmp_path),))
    with pytest.raises(UsageError, match=r"^--toy-map goes with --os auto or toy, not --os cr3$"):
        session.load(spec)


def test_unregistered_its_options_are_gone(toy: ToyOs) -> None:
    registry.unregister(toy.name)
    assert "--toy-depth" not in options.parser().format_help()
    with pytest.raises(KeyError):
        registry.option("toy_depth")
    assert registry.option("kallsyms").symbols  # Linux's names the kernel's symbols


def test_a_domain_s_boot_files_fill_what_was_not_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    kernel, initrd, mine = tmp_path / "vmlinuz", tmp_path / "initrd.img", tmp_path / "my.img"
    booted = BootFiles(kernel, initrd, notes=("a note",))
    monkeypatch.setattr(session.transports, "boot_files", lambda reach: booted)
    reach = Reach(domain="vm")
    spec, notes = session.with_boot_files(session.RunSpec(reach=reach))
    assert (spec.kernel, dict(spec.os_options)) == (kernel, {"initrd": initrd})
    assert notes == (
        "a note",
        f"--kernel {kernel}: the kernel domain vm boots",
        f"--initrd {initrd}: the initrd domain vm boots",
    )
    given = session.RunSpec(reach=reach, kernel=mine, os_options=(("initrd", mine),))
    assert session.with_boot_files(given) == (given, ())
    folder = session.RunSpec(reach=reach, kernel=mine, user_dir=tmp_path)
    assert session.with_boot_files(folder) == (folder, ())  # its programs are there already
