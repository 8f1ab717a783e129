"""``qmpprof record``: argument handling through main([...]), the QEMU command line it builds and
how it names a run (real QEMU runs: tests/e2e/test_record_qemu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from qemus import QEMU

from qmpprof.cli import main, record
from qmpprof.errors import UsageError

# ---- arguments, no QEMU ---------------------------------------------------------------------


def test_split_command_takes_everything_after_the_double_dash() -> None:
    flags, command = record.split_command(["-o", "x.svg", "--", QEMU, "--", "-S"])
    assert (flags, command) == (["-o", "x.svg"], [QEMU, "--", "-S"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--duration", "1"], "record needs the QEMU command after '--'"),
        (["--duration", "1", "--"], "no QEMU command after '--'"),
    ],
)
def test_the_command_is_required(args: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        record.split_command(args)


def test_parse_points_the_options_at_the_private_socket() -> None:
    opts = record.parse(["--duration", "2", "-k"], Path("/tmp/x/qmp.sock"))
    assert opts.spec.reach.qmp_socket == Path("/tmp/x/qmp.sock")
    assert opts.spec.sampling.duration == 2.0 and opts.spec.reach.transport == "auto"


@pytest.mark.parametrize(
    "flag",
    [["--qmp-socket", "s"], ["--qmp", "h:1"], ["--gdb", "h:1"], ["--one-shot"], ["--json"]],
)
def test_connection_flags_are_refused_in_one_line(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["record", *flag, "--", QEMU]) == 2
    err = capsys.readouterr().err
    assert err == f"qmpprof: error: {flag[0]} does not apply to record: it starts QEMU itself\n"


def test_help_shows_record_usage_without_connection_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["record", "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qmpprof record [options] -- QEMU-COMMAND [ARGS...]")
    assert "--duration" in out and "--qmp-socket" not in out and "--one-shot" not in out


def test_a_missing_qemu_binary_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["record", "--", "/nonexistent/qemu-system-x86_64", "-S"]) == 2
    err = capsys.readouterr().err
    assert err == "qmpprof: error: /nonexistent/qemu-system-x86_64: command not found\n"


def test_bad_profiling_flags_fail_before_qemu_starts(capsys: pytest.CaptureFixture[str]) -> None:
    # Were QEMU started, a command that is not there would fail with "command not found".
    assert main(["record", "--interval", "0", "--", "/nonexistent/qemu"]) == 2
    assert capsys.readouterr().err == (
        "qmpprof: error: --interval must be from 0.1 to 5000 ms (no longer than --duration),"
        " not 0\n"
    )


def test_qmp_option_escapes_commas() -> None:
    value = record.qmp_option(Path("/tmp/a,b/qmp.sock"))
    assert value == "unix:/tmp/a,,b/qmp.sock,server=on,wait=off"


@pytest.mark.parametrize(("status", "text"), [(0, "status 0"), (1, "status 1"), (-9, "signal 9")])
def test_describe_status(status: int, text: str) -> None:
    assert record.describe_status(status).endswith(text)


def test_the_run_is_named_by_the_qemu_binary_and_what_it_boots() -> None:
    command = ["/usr/bin/qemu-system-x86_64", "-m", "128M", "-kernel", "/x/kernel.elf", "-S"]
    assert record.command_label(command) == "qemu-system-x86_64 -kernel kernel.elf"
    assert record.command_label(["qemu-system-x86_64"]) == "qemu-system-x86_64"
