"""tests/support/forkserver.py: qmpprof's main forked from a process that imported it, as the
e2e tests that start it hundreds of times use it; against ``python -m qmpprof`` itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.forkserver import ForkServer

ROOT = Path(__file__).resolve().parents[2]


def test_a_forked_run_exits_and_writes_as_the_command_does(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with ForkServer(env, ROOT, ("qmpprof.cli.options",)) as server:
        for argv in (["--bogus"], ["--version"], ["--interval", "0", "--duration", "1"]):
            run = server.start(argv)
            assert run.pid != os.getpid()
            _, err = run.communicate(timeout=60)
            command = subprocess.run(
                [sys.executable, "-m", "qmpprof", *argv],
                capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
            )  # fmt: skip
            assert (run.returncode, err) == (command.returncode, command.stderr), argv
        assert run.returncode != 0 and err.count("\n") == 1  # one clear line
