"""qmpprof serve for a fleet: per-VM settings from TOML, the overhead budget, the loads shared
between VMs of one kernel (against real QEMUs: tests/e2e/test_serve_fleet_guests.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from linuxkernel import linux_dir
from linuxvm import ROOTFS
from servepages import parse_prometheus
from test_serve import filled_vm

from qmpprof.cli import main
from qmpprof.cli.serve import parse
from qmpprof.serve import metrics, views
from qmpprof.session import RunSpec, load
from qmpprof.transport import Reach

# ---- settings ---------------------------------------------------------------------------------


def test_a_config_file_gives_each_vm_its_run_over_the_flags(tmp_path: Path) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(
        """
[vm.web1]
socket = "sockets/web1.qmp"
kernel = "/boot/vmlinuz-6.12"
user_dir = "rootfs"
interval = 20
max_overhead = "none"
off_cpu = true

[vm.db]
kernel = "kernels/vmlinuz-6.1"
kallsyms = "kernels/System.map-6.1"
os = "linux"
max_overhead = 2.5
"""
    )
    served = parse(["--config", str(config), "--qmp-socket", "db=/run/db.qmp",
                    "--kernel", "/k/default", "--interval", "40"])  # fmt: skip
    assert served.sockets == (("db", Path("/run/db.qmp")), ("web1", tmp_path / "sockets/web1.qmp"))
    web1, db, other = (served.spec_of(name) for name in ("web1", "db", "other"))
    assert (web1.kernel, web1.user_dir) == (Path("/boot/vmlinuz-6.12"), tmp_path / "rootfs")
    assert (web1.sampling.interval, web1.sampling.max_overhead) == (0.020, None)
    assert (web1.off_cpu, db.off_cpu, parse(["--off-cpu", "--qmp-socket", "a"]).spec.off_cpu) == (
        True,
        False,
        True,
    )
    assert (db.kernel, dict(db.os_options)) == (
        tmp_path / "kernels/vmlinuz-6.1",
        {"kallsyms": tmp_path / "kernels/System.map-6.1"},
    )
    assert (db.os, db.sampling.interval, db.sampling.max_overhead) == ("linux", 0.040, 0.025)
    assert (other.kernel, other.sampling.max_overhead) == (Path("/k/default"), 0.01)  # the flags


def test_name_toml_beside_a_socket_overrides_the_config(tmp_path: Path) -> None:
    from qmpprof.serve.vm import Vm

    config = tmp_path / "fleet.toml"
    config.write_text('[vm.vm7]\nkernel = "/k/from-config"\ninterval = 30\n')
    served = parse(["--config", str(config), "--qmp-dir", str(tmp_path)])
    vm = Vm(
        "vm7", Reach(qmp_socket=tmp_path / "vm7"), served.spec_of("vm7"), 60, tmp_path / "vm7.toml"
    )
    assert (vm.settings().kernel, vm.settings().sampling.interval) == (Path("/k/from-config"), 0.03)
    (tmp_path / "vm7.toml").write_text('kernel = "vmlinuz-7"\nmax_overhead = 0\n')
    spec = vm.settings()
    assert (spec.kernel, spec.sampling.max_overhead) == (tmp_path / "vmlinuz-7", None)
    assert (spec.sampling.interval, spec.reach.qmp_socket) == (0.03, tmp_path / "vm7")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[vm.a]\nkernel = 5\n", "fleet.toml: vm.a.kernel: a path"),
        ("[vm.a]\nkernal = 'x'\n", "fleet.toml: vm.a.kernal: not a key qmpprof knows"),
        ("[vm.a]\ninterval = -1\n", "fleet.toml: vm.a.interval: from 0.1 to 5000 ms"),
        ("[vm.a]\ninterval = true\n", "fleet.toml: vm.a.interval: a finite number"),
        ("[vm.a]\nmax_overhead = 100\n", "fleet.toml: vm.a.max_overhead: a percentage"),
        ("[vm.a]\nos = 'plan9'\n", "fleet.toml: vm.a.os: one of auto, linux"),
        ("[vm.a]\noff_cpu = 1\n", "fleet.toml: vm.a.off_cpu: true or false"),
        ("[vm]\na = 1\n", "fleet.toml: vm.a: not a table"),
        ("kernel = 'x'\n", "fleet.toml: kernel: not a key qmpprof knows (VMs go in [vm.NAME])"),
        ("[vm.a\n", "fleet.toml: not TOML: "),
        ("[vm.a]\nsocket = '/x'\n", "two sockets for the VM 'a'"),
    ],
)
def test_a_bad_config_is_one_line_naming_file_and_key(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(text)
    assert main(["serve", "--config", str(config), "--qmp-socket", "a=/y", "--listen", ":0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qmpprof: error: ") and message in err, err


def test_a_missing_config_and_a_bad_budget_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--config", str(tmp_path / "none.toml")]) == 2
    assert "none.toml: No such file or directory" in capsys.readouterr().err
    for bad in ("x", "100", "-1"):
        assert main(["serve", "--qmp-socket", "/x", "--max-overhead", bad]) == 2
        assert f"--max-overhead: a percentage in (0, 100), 0 or \"none\", not '{bad}'" in (
            capsys.readouterr().err
        )
    for off in ("0", "none"):
        assert (
            parse(["--qmp-socket", "/x", "--max-overhead", off]).spec.sampling.max_overhead is None
        )
    assert parse(["--qmp-socket", "/x"]).spec.sampling.max_overhead == 0.01


@pytest.mark.linux
def test_vms_of_one_kernel_share_its_load_and_not_their_guest() -> None:
    first = load(RunSpec(kernel=linux_dir("6.12") / "vmlinuz", os="linux"))
    again = load(RunSpec(kernel=linux_dir("6.12") / "vmlinuz", user_dir=ROOTFS, os="linux"))
    other = load(RunSpec(kernel=linux_dir("6.1") / "vmlinuz", os="linux"))
    assert first is not again
    assert first.kernel is again.kernel  # type: ignore[attr-defined]
    assert other.kernel is not first.kernel  # type: ignore[attr-defined]


def test_the_budget_and_the_interval_in_force_are_on_the_pages() -> None:
    budgeted, free = filled_vm("a"), filled_vm("b")
    budgeted.interval = 0.2
    free.spec = RunSpec()  # no budget
    budgeted.spec = parse(["--qmp-socket", "/x"]).spec
    parsed = parse_prometheus(metrics.scraper(lambda: [budgeted, free])().decode())
    assert parsed["qmpprof_interval_seconds"][(("vm", "a"),)] == 0.2
    assert parsed["qmpprof_overhead_budget_ratio"] == {(("vm", "a"),): 0.01}
    assert parsed["qmpprof_rate_hz"][(("vm", "a"),)] > 0
    page = views.index([budgeted, free], 60)
    assert "<td>200</td>" in page and "<td>1.00%</td>" in page and "<td>none</td>" in page


def test_walks_stopped_in_kernel_code_are_told_from_those_stopped_in_user_code() -> None:
    from fakes import named_sample

    from qmpprof.profile import Profile
    from qmpprof.serve.ring import Ring

    profile = Profile()
    for names in (
        ("kernel", "[truncated]", "page_fault_[k]"),  # a kernel walk cut short
        ("sh (pid 3)", "[truncated]", "main", "sys_read_[k]"),  # out of the kernel, no user CFI
        ("sh (pid 3)", "[truncated]", "main"),
        ("sh (pid 3)", "_start", "main", "sys_read_[k]"),  # whole
    ):
        profile.add(named_sample(names))
    second = Ring(2).push(profile, 0.0, 1.0, ticks=4, errors=0, pauses=[0.001] * 4)
    assert (second.samples, second.truncated, second.truncated_in_kernel) == (4, 3, 1)
