"""The three stages of SIGINT/SIGTERM (qmpprof/interrupts.py), with real signals sent to this
process: raised before QEMU is touched, the loop's within a run, ignored while ending."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import weakref

import pytest

from qmpprof.cli import main
from qmpprof.interrupts import Interrupted, installed, interrupts


def test_stage_one_raises_where_the_program_is_and_restores_the_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as raised, installed():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # let the handler run here, if not already
    assert raised.value.signum == signal.SIGTERM and raised.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before


async def test_stage_two_calls_on_first_then_cancels_and_names_the_signal() -> None:
    seen: list[int] = []
    with pytest.raises(Interrupted) as raised, interrupts(seen.append):
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.05)
        assert seen == [signal.SIGINT]  # the first: only asked
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.Event().wait()  # the second cancels this
    assert raised.value.signum == signal.SIGINT  # the run was ended by the first


async def test_a_cancellation_without_a_signal_stays_one() -> None:
    with pytest.raises(asyncio.CancelledError), interrupts(lambda signum: None):
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)


def test_a_dropped_stage_one_signal_is_raised_when_stage_two_begins() -> None:
    """Python drops an exception raised inside a weakref callback ("Exception ignored in"):
    the run must not go on to open anything in QEMU as if nothing had happened."""

    class Thing:
        pass

    reached: list[str] = []

    async def run() -> None:
        reached.append("run")
        with interrupts(lambda signum: None):
            raise AssertionError("stage 2 began")

    def signalled(ref: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs in here: its raise is dropped
        signal.sigtimedwait([], 0)

    with pytest.raises(Interrupted), installed():
        thing = Thing()
        watch = weakref.ref(thing, signalled)
        del thing
        asyncio.run(run())
    assert reached == ["run"] and watch() is None


def test_the_program_ignores_signals_once_its_command_returned() -> None:
    """main() as the program (argv None): a SIGTERM after the command, while Python exits,
    does not turn a finished run into a killed one."""
    code = (
        "import os, signal, sys; from qmpprof.cli import main;"
        " sys.argv = ['qmpprof', '--version']; main();"
        " os.kill(os.getpid(), signal.SIGTERM); print('after')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.endswith("after\n"), done


def test_a_signal_while_parsing_or_loading_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def load(spec: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)
        raise AssertionError("not interrupted")

    monkeypatch.setattr("qmpprof.session.load", load)
    monkeypatch.setattr("qmpprof.session.check_socket", lambda path: None)  # told before load
    assert main(["--qmp-socket", "/nonexistent"]) == 143
    assert capsys.readouterr().err == "qmpprof: interrupted by SIGTERM\n"


def test_a_signal_while_the_handlers_are_put_in_place_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CI met a SIGINT between two ``signal.signal`` calls of stage 1's start: the one that
    arrives then is held and raised inside the command, not in ``installed`` itself."""
    real = signal.signal

    def install(signum: int, handler: object) -> object:
        if signum == signal.SIGTERM and handler not in (signal.SIG_IGN, signal.SIG_DFL):
            os.kill(os.getpid(), signal.SIGINT)  # after SIGINT's handler, before SIGTERM's
        return real(signum, handler)  # type: ignore[arg-type]

    monkeypatch.setattr(signal, "signal", install)
    before = signal.getsignal(signal.SIGINT)
    assert main(["--version"]) == 130
    assert capsys.readouterr().err == "qmpprof: interrupted by SIGINT\n"
    assert signal.getsignal(signal.SIGINT) is before
