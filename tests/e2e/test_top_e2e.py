"""``qmpprof top`` end to end, driven in tmux as a person would (send-keys, capture-pane),
against the bundled guest: the shares on the screen are those of the window ``-o`` writes on
the way out (the samples behind the screen, counted again from the file); keys sort, filter
and freeze; ``q`` and Ctrl-C leave the terminal's settings and the guest's run state as they
were."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from qemus import every_qemu
from witnessvm import Vm, vm

from qmpprof.output import folded

pytestmark = [pytest.mark.qemu, every_qemu]

DEADLINE = 90.0  # a loaded 2-core host: qmpprof's start, then enough samples
ENOUGH = 100  # samples in the window before the screen is read
ONE = 30  # of one process's kernel-mode samples (a few per cent of all)
ROW = re.compile(r"^\s*(\d+\.\d)\s+(\d+\.\d)  (.+)$")
SAMPLES = re.compile(r"^samples (\d+) in the last")


@dataclass
class Pane:
    """One tmux server of the test's own, one window running ``top`` then recording how it
    ended; the pane stays for capture after."""

    server: str
    folder: Path

    def tmux(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.server, *args], capture_output=True, text=True, check=True
        )
        return out.stdout

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def screen(self) -> list[str]:
        return self.tmux("capture-pane", "-p", "-t", "top").splitlines()

    def wait(self, what: str, test: object) -> list[str]:
        """The screen, once ``test(screen)`` holds."""
        deadline = time.monotonic() + DEADLINE
        while True:
            lines = self.screen()
            if test(lines):  # type: ignore[operator]
                return lines
            assert time.monotonic() < deadline, f"no {what} on the screen:\n" + "\n".join(lines)
            time.sleep(0.1)

    def ended(self) -> int:
        rc = self.folder / "rc"
        deadline = time.monotonic() + DEADLINE
        while not rc.exists() or not (self.folder / "after").exists():
            assert time.monotonic() < deadline, "top did not end:\n" + "\n".join(self.screen())
            time.sleep(0.1)
        return int(rc.read_text())


def started(machine: Vm, folder: Path, *flags: str) -> Iterator[Pane]:
    kernel = machine.guest.kernel_elf
    top = [sys.executable, "-m", "qmpprof", "top", "--qmp-socket", machine.socket,
           "--kernel", str(kernel), "-o", str(folder / "window.folded"), *flags]  # fmt: skip
    f = shlex.quote
    rc, after = f(str(folder / "rc")), f(str(folder / "after"))
    # rc and after are written aside and moved into place: ended() waits for both to exist,
    # and a file the shell has created but stty not yet written reads empty.
    script = (
        f"stty -g > {f(str(folder / 'before'))}; {shlex.join(top)} 2> {f(str(folder / 'err'))}; "
        f"echo $? > {rc}.part; stty -g > {after}.part; mv {after}.part {after}; "
        f"mv {rc}.part {rc}; sleep 600"
    )
    pane = Pane(f"qmpprof-top-{folder.name}", folder)
    pane.tmux("new-session", "-d", "-s", "top", "-x", "220", "-y", "60", script)
    try:
        yield pane
    finally:
        subprocess.run(["tmux", "-L", pane.server, "kill-server"], capture_output=True)


def samples(lines: list[str]) -> int:
    found = [int(m.group(1)) for line in lines if (m := SAMPLES.match(line))]
    return found[0] if found else 0


def rows(lines: list[str]) -> list[tuple[float, float, str]]:
    return [(float(m[1]), float(m[2]), m[3]) for line in lines if (m := ROW.match(line))]


def shares(stacks: list[tuple[tuple[str, ...], int]]) -> dict[str, tuple[float, float]]:
    """Per function of a folded file: (own %, total %), counted as the screen counts."""
    n = sum(count for _, count in stacks)
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for names, count in stacks:
        frames = names[1:] or names
        own[frames[-1]] += count
        for name in set(frames):
            total[name] += count
    return {name: (100 * own[name] / n, 100 * total[name] / n) for name in total}


def check_screen_is_the_file(
    screen: list[str], pane: Pane, enough: int = ENOUGH
) -> list[tuple[tuple[str, ...], int]]:
    """Every row shown = the written window's figures (to the screen's 0.1 rounding)."""
    stacks = folded.parse((pane.folder / "window.folded").read_text())
    assert sum(count for _, count in stacks) == samples(screen) >= enough
    from_file = shares(stacks)
    shown = rows(screen)
    assert len(shown) >= 3, screen
    for own, total, name in shown:
        assert name in from_file, (name, sorted(from_file))
        want = from_file[name]
        assert abs(own - want[0]) <= 0.051 and abs(total - want[1]) <= 0.051, (name, own, total)
    return stacks


def check_left_as_found(machine: Vm, pane: Pane) -> None:
    assert (pane.folder / "before").read_text() == (pane.folder / "after").read_text()
    assert machine.witness.execute("query-status")["running"]
    assert machine.advances()


def test_the_screen_shows_the_window_it_writes(tmp_path: Path) -> None:
    with vm(tmp_path, smp=2) as machine:
        for pane in started(machine, tmp_path):
            pane.wait(f"{ENOUGH} samples", lambda s: samples(s) >= ENOUGH)
            pane.keys("t")
            pane.wait("sort by total", lambda s: "by total share" in s[0])
            pane.keys("p")
            screen = pane.wait("frozen view", lambda s: "[frozen" in s[0])
            pane.keys("q")
            assert pane.ended() == 0, (pane.folder / "err").read_text()
            check_screen_is_the_file(screen, pane)
            totals = [total for _, total, _ in rows(screen)]
            assert totals == sorted(totals, reverse=True)
            check_left_as_found(machine, pane)
    err = (tmp_path / "err").read_text()
    assert "Traceback" not in err and "the window last shown" in err, err


def test_kernel_mode_and_one_process_then_ctrl_c(tmp_path: Path) -> None:
    with vm(tmp_path, smp=2) as machine:
        for pane in started(machine, tmp_path, "--window", "60"):
            pane.wait(f"{ENOUGH} samples", lambda s: samples(s) >= ENOUGH)
            pane.keys("k")
            pane.wait("kernel only", lambda s: "kernel only" in s[0])
            pane.keys("n")
            pane.wait("one process", lambda s: "kernel only, " in s[0])
            pane.wait(f"{ONE} samples", lambda s: samples(s) >= ONE)
            pane.keys("p")
            screen = pane.wait("frozen view", lambda s: "[frozen" in s[0])
            pane.keys("C-c")
            assert pane.ended() == 0, (pane.folder / "err").read_text()
            stacks = check_screen_is_the_file(screen, pane, ONE)
            chosen = screen[0].split("kernel only, ", 1)[1].split("   [frozen")[0]
            assert {names[0] for names, _ in stacks} == {chosen}
            for names, _ in stacks:  # kernel mode: kernel frames alone
                assert all(n.endswith("_[k]") or n.startswith("[") for n in names[1:]), names
            check_left_as_found(machine, pane)
    assert "stopped by SIGINT" in (tmp_path / "err").read_text()
