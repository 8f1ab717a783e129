"""qmpprof serve for a fleet: per-VM settings from TOML, the overhead budget, the loads shared
between VMs of one kernel; then against real QEMUs: two Linux guests on two Debian kernels
served side by side, each from its own settings, one under the default budget; and a real
Prometheus server (Debian's, fixtures/build/prometheus) scraping serve's /metrics."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import urllib.parse
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from guestvm import running_guest
from linuxkernel import linux_dir
from linuxvm import ROOTFS, running_linux_guest
from test_output_pprof import decode
from test_serve import Served, filled_vm, get, parse_prometheus, serve_command, wait_until

from qmpprof.budget import HEADROOM
from qmpprof.cli import main
from qmpprof.cli.serve import parse
from qmpprof.serve import views
from qmpprof.session import RunSpec, load

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "fixtures" / "build" / "prometheus" / "prometheus"
Metrics = dict[str, dict[tuple[tuple[str, str], ...], float]]  # parse_prometheus's

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
    assert (db.kernel, db.kallsyms) == (
        tmp_path / "kernels/vmlinuz-6.1",
        tmp_path / "kernels/System.map-6.1",
    )
    assert (db.os, db.sampling.interval, db.sampling.max_overhead) == ("linux", 0.040, 0.025)
    assert (other.kernel, other.sampling.max_overhead) == (Path("/k/default"), 0.01)  # the flags


def test_name_toml_beside_a_socket_overrides_the_config(tmp_path: Path) -> None:
    from qmpprof.serve.vm import Vm

    config = tmp_path / "fleet.toml"
    config.write_text('[vm.vm7]\nkernel = "/k/from-config"\ninterval = 30\n')
    served = parse(["--config", str(config), "--qmp-dir", str(tmp_path)])
    vm = Vm("vm7", tmp_path / "vm7", served.spec_of("vm7"), 60, tmp_path / "vm7.toml")
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
    parsed = parse_prometheus(views.metrics([budgeted, free]))
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


# ---- against real QEMUs ---------------------------------------------------------------------


def serving(*args: str) -> AbstractContextManager[Served]:
    return serve_command(*args, cwd=ROOT)


@pytest.mark.qemu
@pytest.mark.linux
def test_two_kernels_served_side_by_side_each_whole_one_under_the_budget(tmp_path: Path) -> None:
    """Linux 6.12 and 6.1 each boot the test guest; serve follows both from one TOML file:
    "new" at 20 ms without a budget and with the tasks off CPU, "old" at the default budget of
    1 %. New's served flame graph and profile hold its blocked tasks. Each VM's stacks are
    whole in its kernel (its own kernel loaded; the guest's busybox has no .eh_frame, so 1-3 %
    of its stacks stop in user code whatever the kernel); the budget lengthens old's interval
    to what its pauses ask for."""
    with (
        running_linux_guest(tmp_path, kernel=linux_dir("6.12") / "vmlinuz", dump_kallsyms=False)
        as new,
        running_linux_guest(tmp_path, kernel=linux_dir("6.1") / "vmlinuz", dump_kallsyms=False)
        as old,
    ):  # fmt: skip
        config = tmp_path / "fleet.toml"
        config.write_text(
            f'[vm.new]\nsocket = "{new.qmp_socket}"\nkernel = "{linux_dir("6.12")}/vmlinuz"\n'
            f'interval = 20\nmax_overhead = "none"\nuser_dir = "{ROOTFS}"\noff_cpu = true\n\n'
            f'[vm.old]\nsocket = "{old.qmp_socket}"\nkernel = "{linux_dir("6.1")}/vmlinuz"\n'
            f'user_dir = "{ROOTFS}"\n'
        )
        with serving("--config", str(config), "--interval", "20") as served:
            samples = lambda: served.per_vm("qmpprof_samples_total")  # noqa: E731
            wait_until("200 samples of new, 20 of old",
                       lambda: samples().get("new", 0) >= 200 and samples().get("old", 0) >= 20,
                       timeout=150)  # fmt: skip
            wait_until("new's tasks off CPU", lambda: served.per_vm(
                "qmpprof_offcpu_samples_total").get("new", 0) > 0, timeout=30)  # fmt: skip
            flame = get(served.url + "flamegraph.svg?vm=new&seconds=60")[2].decode()
            profile = get(served.url + "debug/pprof/profile?vm=new&seconds=3")[2]
            metrics = served.metrics()
            code, err = served.stop()
        assert code == 0, err
    one = lambda name, vm: metrics[name][(("vm", vm),)]  # noqa: E731
    print({name: dict(values) for name, values in metrics.items() if "bucket" not in name})
    for vm in ("new", "old"):
        assert one("qmpprof_errors_total", vm) <= 0.01 * one("qmpprof_samples_total", vm)
        whole = one("qmpprof_samples_total", vm) - one("qmpprof_truncated_in_kernel_total", vm)
        assert whole >= 0.99 * one("qmpprof_samples_total", vm), vm
        assert one("qmpprof_truncated_total", vm) <= 0.05 * one("qmpprof_samples_total", vm), vm
    assert one("qmpprof_interval_seconds", "new") == 0.02
    assert one("qmpprof_offcpu_samples_total", "old") == 0
    # The test guest's sleeper (its own `sleep`) waits in do_nanosleep the whole run.
    assert 'data-view="wall"' in flame and "[off-cpu: S]" in flame and "do_nanosleep" in flame
    labels = [s[2] for s in decode(profile).samples]
    assert {"oncpu", "offcpu"} <= {label["cpu_state"] for label in labels}
    assert ("vm", "new") not in {k[0] for k in metrics["qmpprof_overhead_budget_ratio"]}
    assert one("qmpprof_overhead_budget_ratio", "old") == 0.01
    # Old's pauses cost more than 1 % at 20 ms: its interval in force grew to the one the
    # budget asks for its pauses, which lie between the least and the most of those it counted.
    interval = one("qmpprof_interval_seconds", "old")
    pause_old = one("qmpprof_pause_seconds_sum", "old") / one("qmpprof_pause_seconds_count", "old")
    assert pause_old / (pause_old + 0.02) > 0.01, pause_old  # else nothing to lengthen
    least, most = pause_range(metrics, "old")
    asked = (budget_interval(least), budget_interval(most))
    assert interval > 0.1 and asked[0] <= interval <= asked[1], (interval, least, most)
    # The share of the time old stood stopped is scripts/bench's (--serve-soak) to measure:
    # past the longest interval (pauses over 45 ms, a loaded host) it is the pauses' to set.


def pause_range(metrics: Metrics, vm: str) -> tuple[float, float]:
    """The least and the most a pause of ``vm`` can have been, from serve's histogram: the
    lower bound of the first bucket counted in, the upper bound of the last (a pause past the
    last bound: infinite)."""
    counts = sorted(
        (float(dict(labels)["le"]), count)
        for labels, count in metrics["qmpprof_pause_seconds_bucket"].items()
        if dict(labels)["vm"] == vm
    )  # cumulative, "+Inf" last
    bounds = [0.0] + [bound for bound, _ in counts]
    grew = [i for i in range(len(counts)) if counts[i][1] > (counts[i - 1][1] if i else 0)]
    return bounds[grew[0]], bounds[grew[-1] + 1]


def budget_interval(pause: float) -> float:
    """The interval the sampler asks for under old's budget (1 %, aimed at 0.9 %) for pauses
    of ``pause`` seconds: within the asked 20 ms and the longest, 5 s."""
    aim = 0.01 * HEADROOM
    return min(5.0, max(0.02, pause * (1 - aim) / aim))


@pytest.mark.qemu
def test_a_vm_of_the_socket_dir_takes_its_name_toml(tmp_path: Path) -> None:
    """serve's flags name no kernel; vm7.toml beside the socket gives the bundled guest's, its
    interval and no budget. A bad one leaves the VM down, the reason on the index page."""
    watched = Path(tempfile.mkdtemp(prefix="qg-toml-", dir="/tmp"))
    try:
        with (
            running_guest(tmp_path, "cfi", 1) as guest,
            serving("--qmp-dir", str(watched)) as served,
        ):
            (watched / "bad.toml").write_text("interval = 'fast'\n")
            (watched / "bad").symlink_to(guest.qmp_socket)
            bad = b"bad.toml: interval: a number of milliseconds, not a string"
            wait_until("bad is shown down", lambda: bad in get(served.url)[2])
            (watched / "bad").unlink()
            (watched / "vm7.toml").write_text(
                f'kernel = "{guest.kernel_elf}"\nuser_dir = "{guest.user_dir}"\n'
                'interval = 20\nmax_overhead = "none"\n'
            )
            (watched / "vm7").symlink_to(guest.qmp_socket)
            samples = lambda: served.per_vm("qmpprof_samples_total").get("vm7", 0)  # noqa: E731
            wait_until("vm7 sampled", lambda: samples() >= 50)
            metrics = served.metrics()
            code, err = served.stop()
        assert code == 0, err
    finally:
        shutil.rmtree(watched, ignore_errors=True)
    vm7 = (("vm", "vm7"),)
    assert metrics["qmpprof_interval_seconds"][vm7] == 0.02
    assert vm7 not in metrics.get("qmpprof_overhead_budget_ratio", {})
    # The kernel ELF named in vm7.toml was loaded: the guest's kernel stacks walk whole.
    assert metrics["qmpprof_truncated_total"][vm7] <= 0.01 * metrics["qmpprof_samples_total"][vm7]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def prometheus(tmp_path: Path, target: str) -> Iterator[str]:
    """Debian's Prometheus on loopback scraping ``target`` (HOST:PORT) every second; its URL."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: qmpprof\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until("Prometheus ready", lambda: _ready(url, proc, tmp_path), timeout=60)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _ready(url: str, proc: subprocess.Popen[bytes], tmp_path: Path) -> bool:
    assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
    try:
        return get(url + "/-/ready")[0] == 200
    except OSError:
        return False


def query(url: str, expr: str) -> dict[str, float]:
    """An instant query's answer, vm label -> value."""
    status, _, body = get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert status == 200, body
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    return {r["metric"].get("vm", ""): float(r["value"][1]) for r in answer["data"]["result"]}


@pytest.mark.qemu
def test_prometheus_scrapes_each_vm_s_sample_counter(tmp_path: Path) -> None:
    """Two bundled guests served; Prometheus scrapes /metrics. Once both QEMUs are gone the
    counters stand still: Prometheus's query API then answers each VM's counter as serve does."""
    assert PROMETHEUS.is_file(), f"no {PROMETHEUS}: run scripts/fetch-prometheus"
    sock_dir = Path(tempfile.mkdtemp(prefix="qg-prom-", dir="/tmp"))
    try:
        (sock_dir / "a").mkdir()
        (sock_dir / "b").mkdir()
        with serving(
            "--qmp-socket", f"a={sock_dir / 'a' / 'qmp.sock'}",
            "--qmp-socket", f"b={sock_dir / 'b' / 'qmp.sock'}",
            "--kernel", str(ROOT / "fixtures/build/cfi/kernel.elf"),
            "--user-dir", str(ROOT / "fixtures/build/cfi/user"),
        ) as served:  # fmt: skip
            target = urllib.parse.urlsplit(served.url).netloc
            with prometheus(tmp_path, target) as prom:
                with (
                    running_guest(tmp_path, "cfi", 1, sock_dir=sock_dir / "a"),
                    running_guest(tmp_path, "cfi", 1, sock_dir=sock_dir / "b"),
                ):
                    wait_until("both sampled, as Prometheus saw it",
                               lambda: min(query(prom, "qmpprof_samples_total").values(),
                                           default=0) > 0, timeout=60)  # fmt: skip
                # Both QEMUs are gone: the VMs are down and their counters stand still.
                wait_until("both down", lambda: set(served.per_vm("qmpprof_vm_up").values()) == {0})
                counted = served.per_vm("qmpprof_samples_total")
                wait_until("Prometheus has the last counts",
                           lambda: query(prom, "qmpprof_samples_total") == counted)  # fmt: skip
                up = query(prom, 'up{job="qmpprof"}')  # Prometheus's own: did the scrapes work
            code, err = served.stop()
        assert code == 0, err
        assert set(counted) == {"a", "b"} and min(counted.values()) > 0
        assert up == {"": 1.0}
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
