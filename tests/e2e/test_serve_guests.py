"""qmpprof serve as a process of its own against real QEMUs running the bundled guest: go tool
pprof on its endpoint, the pages in Chromium, a VM killed and started again on the same socket,
a paused guest left paused, a socket dir followed."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from gopprof import go_pprof
from guestvm import Guest, expected, running_guest
from qemus import every_qemu
from servepages import Served, get, serve_command, status

# ---- the daemon against real QEMUs ----------------------------------------------------------


@contextmanager
def serving(guest: Guest, *args: str) -> Iterator[Served]:
    # These tests count on samples coming at --interval: no overhead budget
    # (test_serve_fleet_guests.py has the budget's).
    files = ["--kernel", str(guest.kernel_elf), "--user-dir", str(guest.user_dir)]
    with serve_command(*files, "--max-overhead", "none", *args) as served:
        yield served


def wait_until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.2)


@pytest.mark.qemu
@every_qemu
def test_go_tool_pprof_reads_the_guest_functions_from_the_endpoint(tmp_path: Path) -> None:
    with (
        running_guest(tmp_path, "cfi", 1) as guest,
        serving(guest, "--qmp-socket", f"vm1={guest.qmp_socket}", "--interval", "20") as served,
    ):
        wait_until("first samples", lambda: served.per_vm("qmpprof_samples_total")["vm1"] > 0)
        url = served.url + "debug/pprof/profile?seconds=2"
        raw = go_pprof(tmp_path, "-raw", url)
        top = go_pprof(tmp_path, "-top", "-nodefraction=0", "-sample_index=samples", url)
        code, err = served.stop()
        assert status(guest) == "running"
    assert code == 0, err
    assert "Comment: guest: vm1" in raw and "Samples:" in raw
    samples = re.search(r"Comment: samples: (\d+)", raw)
    assert samples is not None and int(samples[1]) >= 20  # 2 s at 20 ms asks for ~80
    functions = {*expected()["programs"]["spin"]["shares"], "kworker_main"}
    assert functions <= set(re.findall(r"\w+", raw)), raw
    assert "spin_hot" in top


@pytest.mark.qemu
@every_qemu
@pytest.mark.browser
def test_index_and_flamegraph_load_in_chromium(tmp_path: Path) -> None:
    from browser import chromium, expect

    with (
        running_guest(tmp_path, "cfi", 1) as guest,
        serving(guest, "--qmp-socket", f"vm1={guest.qmp_socket}") as served,
    ):
        wait_until("two seconds in the ring", lambda: served.per_vm(
            "qmpprof_samples_total")["vm1"] >= 20)  # fmt: skip
        with chromium(tmp_path / "chromium") as context:
            errors: list[str] = []
            tab = context.new_page()
            tab.on("pageerror", lambda err: errors.append(str(err)))
            tab.goto(served.url)
            row = tab.locator("tr.vm")
            expect(row).to_have_count(1)
            expect(row.locator("td").nth(0)).to_have_text("vm1")
            expect(row.locator("td").nth(1)).to_have_text("up")
            tab.locator("a", has_text="flame graph").click()
            tab.wait_for_url("**/flamegraph.svg?*")
            expect(tab.locator("#title")).to_contain_text("vm1")
            main_frame = tab.locator("g.f").filter(has=tab.locator('title:text-matches("^main ")'))
            assert main_frame.count() >= 1
            main_frame.first.click()
            expect(tab.locator("#reset")).to_be_visible()
            tab.close()
        assert errors == []


@pytest.mark.qemu
@every_qemu
def test_a_killed_vm_comes_back_on_its_socket_and_the_other_never_stops(tmp_path: Path) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="qg-serve-", dir="/tmp"))
    again_socket = sock_dir / "qmp.sock"
    try:
        with running_guest(tmp_path, "cfi", 1) as steady, serving(
            steady, "--qmp-socket", f"steady={steady.qmp_socket}", "--qmp-socket",
            f"again={again_socket}",
        ) as served:  # fmt: skip
            counts = lambda: served.per_vm("qmpprof_samples_total")  # noqa: E731
            up = lambda: served.per_vm("qmpprof_vm_up")  # noqa: E731
            assert up()["again"] == 0  # not there yet: down, not an error
            with running_guest(tmp_path, "cfi", 1, sock_dir=sock_dir):
                wait_until("both sampled", lambda: min(counts().values()) > 0)
            # The QEMU of "again" was killed: it goes down, "steady" goes on.
            wait_until("again is down", lambda: up()["again"] == 0)
            down_at, steady_at = counts()["again"], counts()["steady"]
            wait_until("steady grows", lambda: counts()["steady"] > steady_at)
            assert counts()["again"] == down_at
            steady_at = counts()["steady"]
            with running_guest(tmp_path, "cfi", 1, sock_dir=sock_dir) as second:
                wait_until("again profiled again", lambda: counts()["again"] > down_at + 10)
                assert up() == {"steady": 1, "again": 1}
                assert counts()["steady"] > steady_at
                code, err = served.stop()
                assert code == 0, err
                assert "Traceback" not in err
                assert status(steady) == "running" and status(second) == "running"
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.mark.qemu
@every_qemu
def test_a_paused_guest_is_shown_paused_and_left_paused(tmp_path: Path) -> None:
    with running_guest(tmp_path, "cfi", 1, paused=True) as guest:
        before = status(guest)
        with serving(guest, "--qmp-socket", f"p={guest.qmp_socket}") as served:
            wait_until("looked at", lambda: b'class="paused"' in get(served.url)[2])
            assert served.per_vm("qmpprof_vm_up") == {"p": 0}
            assert served.per_vm("qmpprof_samples_total") == {"p": 0}
            code, err = served.stop()
            assert code == 0, err
        assert status(guest) == before != "running"


@pytest.mark.qemu
@every_qemu
def test_a_socket_dir_is_followed_and_healthz_is_ok(tmp_path: Path) -> None:
    watched = Path(tempfile.mkdtemp(prefix="qg-dir-", dir="/tmp"))
    try:
        with (
            running_guest(tmp_path, "cfi", 1) as guest,
            serving(guest, "--qmp-dir", str(watched)) as served,
        ):
            assert get(served.url + "healthz")[::2] == (200, b"ok\n")
            assert served.metrics().get("qmpprof_vm_up", {}) == {}
            (watched / "vm7").symlink_to(guest.qmp_socket)
            sampled = lambda: served.per_vm("qmpprof_samples_total").get("vm7", 0) > 0  # noqa: E731
            wait_until("vm7 sampled", sampled)
            (watched / "vm7").unlink()
            wait_until("vm7 dropped", lambda: "vm7" not in served.per_vm("qmpprof_vm_up"))
            code, err = served.stop()
            assert code == 0, err
            assert status(guest) == "running"
    finally:
        shutil.rmtree(watched, ignore_errors=True)
