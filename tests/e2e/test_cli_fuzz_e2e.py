"""Seeded random command lines against the bundled guest: flag values drawn from edge cases
(nan, inf, 0, negatives, huge, text), sockets, outputs and files that are the right thing, a
file, a folder, missing, held by another client. Every line ends within its bound, with an exit
code of README's table and, when it fails, one line; none leaves a traceback or the guest
stopped. Most lines run in-process (``main`` with stderr captured), a few as real processes.

``QMPPROF_FUZZ_SEED=N`` runs one seed again (the seed is printed)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from exitcodes import documented_codes
from guestvm import Guest, run_state
from qemus import every_qemu
from qmpgreeter import Server

from qmpprof.cli import main

pytestmark = [pytest.mark.qemu, every_qemu]

ROOT = Path(__file__).resolve().parents[2]
LINES = 500
PROCESSES = 5  # of them, run as real processes
SLACK = 15.0  # seconds a line may take beyond its --duration: loading, connecting, writing

NUMBERS = ["nan", "inf", "-inf", "0", "-1", "1e-9", "1e9", "1e308", "9223372036854776.0", "x", ""]
CHOICES = {
    "--interval": [*NUMBERS, "0.05", "2", "10", "20"],
    "--duration": [*NUMBERS, "86401", "0.05", "0.1"],
    "--jitter": [*NUMBERS, "0.5", "1"],
    "--max-overhead": [*NUMBERS, "100", "50"],
    "--cpus": ["0", "1", "7", "0-99999999999", "x", "-1", "0,0", "3-1"],
    "--transport": ["auto", "qmp", "gdb", "tcp"],
    "--kernel-boundary": ["0", "0xffffffff80000000", "1e9", "-1", "0x1" + "0" * 20],
}


@dataclass
class Places:
    """The sockets, outputs and files a line may name."""

    sockets: list[str]
    outputs: list[str]
    kernels: list[str]
    user_dirs: list[str]


def places(guest: Guest, tmp: Path, held: Path, stale: Path) -> Places:
    (tmp / "file").write_text("not an ELF")
    (tmp / "folder").mkdir()
    live = str(guest.qmp_socket)
    return Places(
        sockets=[live, live, live, live, str(held), str(stale), str(tmp / "file"),
                 str(tmp / "folder"), str(tmp / "missing")],
        outputs=[str(tmp / "x.svg"), str(tmp / "x.folded"), str(tmp / "x.pb.gz"), "-",
                 str(tmp / "nodir" / "x.svg"), str(tmp / "out.html"), str(tmp / "folder")],
        kernels=[str(guest.kernel_elf)] * 3 + [str(tmp / "file"), str(tmp / "folder"),
                                              str(tmp / "missing")],
        user_dirs=[str(guest.user_dir)] * 2 + [str(tmp / "file"), str(tmp / "missing")],
    )  # fmt: skip


def command_line(rng: random.Random, where: Places) -> list[str]:
    # A short run unless an edge value of --duration comes after (argparse keeps the last).
    argv = ["--duration", rng.choice(["0.05", "0.1"])]
    for flag, values in CHOICES.items():
        if rng.random() < 0.3:
            argv += [flag, rng.choice(values)]
    argv += ["--qmp-socket", rng.choice(where.sockets)]
    if rng.random() < 0.5:
        argv += ["-o", rng.choice(where.outputs)]
    if rng.random() < 0.5:
        argv += ["--kernel", rng.choice(where.kernels)]
    if rng.random() < 0.3:
        argv += ["--user-dir", rng.choice(where.user_dirs)]
    if rng.random() < 0.1:
        argv += ["--one-shot"]
    if rng.random() < 0.05:
        argv.insert(0, rng.choice(["recrod", "reprot", "x"]))
    return argv


def bound(argv: list[str]) -> float:
    """How long a line may take: its last --duration (argparse keeps the last), if a number."""
    given = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--duration"]
    try:
        duration = float(given[-1]) if given else 5.0
    except ValueError:
        duration = 0.0
    return SLACK + (duration if 0 < duration <= 60 else 0.0)


def judge(argv: list[str], code: int, err: str, took: float, codes: set[int]) -> None:
    where = f"qmpprof {' '.join(argv)}"
    assert code in codes, f"{where}: exit {code}\n{err}"
    assert "Traceback" not in err, f"{where}:\n{err}"
    assert took <= bound(argv), f"{where}: took {took:.1f} s"
    if code != 0:
        lines = [line for line in err.splitlines() if line.startswith("qmpprof: error: ")]
        assert len(lines) == 1 and err.endswith(lines[0] + "\n"), f"{where}:\n{err}"


def test_random_command_lines(
    guest: Guest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seed = int(os.environ.get("QMPPROF_FUZZ_SEED", str(random.randrange(1 << 32))))
    with capsys.disabled():
        print(f"QMPPROF_FUZZ_SEED={seed}")
    rng = random.Random(seed)
    codes = documented_codes()
    folder = Path(tempfile.mkdtemp(prefix="qf-", dir="/tmp"))  # short socket paths
    held = Server(folder / "held.sock", hold=True)
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.connect(str(held.path))
    holder.recv(100)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(folder / "stale.sock"))  # a socket file nothing listens on
    where = places(guest, tmp_path, held.path, folder / "stale.sock")
    seen: dict[int, int] = {}
    # The processes run this checkout's qmpprof, whatever the environment installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    this_tree = dict(os.environ, PYTHONPATH=path)
    try:
        for n in range(LINES):
            argv = command_line(rng, where)
            if n < PROCESSES:
                started = time.monotonic()
                done = subprocess.run([sys.executable, "-m", "qmpprof", *argv], env=this_tree,
                                      capture_output=True, text=True, timeout=120)  # fmt: skip
                code, err = done.returncode, done.stderr
            else:
                started = time.monotonic()
                code = main(argv)
                err = capsys.readouterr().err
            judge(argv, code, err, time.monotonic() - started, codes)
            seen[code] = seen.get(code, 0) + 1
            assert run_state(guest.qmp_socket) == "running", f"qmpprof {' '.join(argv)}"
    finally:
        holder.close()
        held.close()
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()
    with capsys.disabled():
        print(f"exit codes of {LINES} lines: {dict(sorted(seen.items()))}")
    # The lines got past the flags and the socket too: some sampled.
    assert {0, 2, 3} <= set(seen), seen


def test_a_held_socket_and_a_missing_vcpu_on_the_real_guest(
    guest: Guest, capsys: pytest.CaptureFixture[str]
) -> None:
    """QEMU's own QMP socket held by another client, then ``--cpus`` past the guest's one
    vCPU: each one line, before any sample, the guest running throughout."""
    socket_path = str(guest.qmp_socket)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
        holder.connect(socket_path)
        assert holder.recv(4096).startswith(b'{"QMP"')  # QEMU serves this client now
        started = time.monotonic()
        assert main(["--qmp-socket", socket_path, "--duration", "0.1"]) == 3
        took = time.monotonic() - started
        err = capsys.readouterr().err
    assert err == (
        f"qmpprof: error: {socket_path}: another client holds this QMP socket (QEMU serves one"
        " at a time): close it, or give the VM a second -qmp socket for qmpprof\n"
    )
    assert took < 5.0  # told by /proc/net/unix, not by the 5 s wait for a greeting
    assert main(["--qmp-socket", socket_path, "--duration", "0.1", "--cpus", "0,7"]) == 2
    err = capsys.readouterr().err
    assert err == "qmpprof: error: --cpus: this guest has no vCPU 7 (its vCPUs: 0)\n"
    assert run_state(guest.qmp_socket) == "running"
