"""qmpprof serve for a fleet against real QEMUs: two Linux guests on two Debian kernels served
side by side, each from its own settings, one under the default budget; a VM of a socket dir
taking its name.toml; and a real Prometheus server (Debian's, fixtures/build/prometheus)
scraping serve's /metrics."""

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
from gopprof import decode
from guestvm import running_guest
from linuxkernel import linux_dir
from linuxvm import ROOTFS, running_linux_guest
from servepages import Served, get, serve_command
from test_serve_guests import wait_until

from qmpprof.budget import HEADROOM

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "fixtures" / "build" / "prometheus" / "prometheus"
Metrics = dict[str, dict[tuple[tuple[str, str], ...], float]]  # parse_prometheus's


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
