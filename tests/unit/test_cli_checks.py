"""Everything a user can get wrong on the command line is told before the guest is touched, in
one line with its exit code, in this order: the flags' values, the QMP socket, the outputs, the
files. The sockets here are made by the tests (a QMP greeter, a held one, a silent one); the
same cases against a real QEMU are in test_cli_fuzz_e2e.py."""

from __future__ import annotations

import gzip
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from exitcodes import documented_codes
from qmpgreeter import GREETING, Server
from test_cli import scripted_guest

from qmpprof import bounds, errors, session
from qmpprof.cli import main
from qmpprof.errors import ConnectError, OutputError, UsageError
from qmpprof.output import folded
from qmpprof.serve.config import settings


@pytest.fixture
def qmp_path() -> Iterator[Path]:
    """A short socket path (sun_path holds 108 bytes; pytest's tmp_path can be longer)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="qc-", dir="/tmp"))
    yield folder / "qmp.sock"
    for child in folder.iterdir():
        child.unlink()
    folder.rmdir()


@pytest.fixture
def greeter(qmp_path: Path) -> Iterator[Server]:
    server = Server(qmp_path)
    yield server
    server.close()


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qmpprof: error: "), err
    return err.removeprefix("qmpprof: error: ").rstrip("\n")


# ---- item 2: numbers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--duration", "nan"], "--duration must be a finite number, not nan"),
        (["--interval", "nan"], "--interval must be a finite number, not nan"),
        (["--duration", "inf"], "--duration must be a finite number, not inf"),
        (["--interval", "1e9", "--duration", "1"], "--interval must be from 0.1 to 1000 ms"),
        (["--interval", "inf", "--duration", "1"], "--interval must be a finite number"),
        (["--interval", "1e-9"], "--interval must be from 0.1 to 5000 ms"),
        (["--duration", "1e300"], "--duration must be more than 0 and at most 86400 seconds"),
        (["--jitter", "nan"], "--jitter must be a finite number, not nan"),
        (["--jitter", "-0.1"], "--jitter must be a fraction in [0, 1)"),
        (["--max-overhead", "inf"], "--max-overhead must be a finite number, not inf"),
        (["--max-overhead", "100"], "--max-overhead must be a percentage in (0, 100)"),
        (["--cpus", "0-99999999999"], "--cpus: vCPU 99999999999: QEMU numbers them below"),
    ],
)
@pytest.mark.parametrize("command", [[], ["record"]])
def test_numbers_are_finite_in_range_and_the_interval_fits_the_duration(
    capsys: pytest.CaptureFixture[str], command: list[str], argv: list[str], message: str
) -> None:
    # No socket, no QEMU command that exists: the value is told first, before either is tried.
    tail = ["--", "/nonexistent/qemu"] if command else ["--qmp-socket", "/nonexistent/sock"]
    assert main([*command, *argv, *tail]) == UsageError.exit_code
    assert message in one_line(capsys)


VALUES = [float("inf"), float("nan"), 1e305, 9223372036854776.0, -1.0, 0.0, 0.05, 0.1, 50.0,
          5000.0, 5000.1]  # fmt: skip


@pytest.mark.parametrize("value", VALUES)
def test_serve_takes_an_interval_by_the_same_rule_as_its_flag(
    capsys: pytest.CaptureFixture[str], value: float
) -> None:
    flag = main(["serve", "--interval", repr(value), "--qmp-socket", "/x", "--window", "0"])
    flag_taken = "--interval" not in capsys.readouterr().err  # --window 0 fails after it
    try:
        settings({"interval": value}, "f: ", Path("."), socket=False)
        toml_taken = True
    except UsageError:
        toml_taken = False
    assert flag == UsageError.exit_code
    assert flag_taken == toml_taken == (0.1 <= value <= 5000)


def test_serve_refuses_a_toml_integer_too_big_for_a_float() -> None:
    with pytest.raises(UsageError, match="f: interval: a finite number"):
        settings({"interval": 10**400}, "f: ", Path("."), socket=False)


def test_bounds_refuse_what_is_not_a_number() -> None:
    for value in (True, None, "x", "nan", [1]):
        with pytest.raises(bounds.OutOfBounds):
            bounds.number(value)
    assert bounds.interval("10", 5.0) == 0.01


# ---- item 6: the socket, told first and plainly ------------------------------------------------


def test_a_file_or_a_directory_is_not_a_socket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    assert main(["--qmp-socket", str(tmp_path / "file")]) == ConnectError.exit_code
    assert (
        one_line(capsys)
        == f"{tmp_path / 'file'}: a file, not a socket (give QEMU's -qmp unix:PATH socket)"
    )
    assert main(["--qmp-socket", str(tmp_path)]) == ConnectError.exit_code
    assert one_line(capsys) == f"{tmp_path}: a directory, not a QMP socket"


def test_a_socket_nothing_listens_on(qmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(qmp_path))  # bound, never listening: what a dead QEMU leaves
    assert main(["--qmp-socket", str(qmp_path)]) == ConnectError.exit_code
    assert one_line(capsys) == f"{qmp_path}: nothing listens on this socket (QEMU gone?)"


def test_a_server_that_is_not_qmp(qmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = Server(qmp_path, hello=b"SSH-2.0-OpenSSH\r\n")
    try:
        assert main(["--qmp-socket", str(qmp_path)]) == ConnectError.exit_code
    finally:
        server.close()
    assert one_line(capsys) == f"{qmp_path}: not a QMP server (it said b'SSH-2.0-OpenSSH\\r\\n')"


def test_a_socket_another_client_holds_is_told_within_a_second(
    qmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = Server(qmp_path, hold=True)
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        holder.connect(str(qmp_path))
        assert holder.recv(100) == GREETING  # accepted: the server now serves it alone
        started = time.monotonic()
        assert main(["--qmp-socket", str(qmp_path)]) == ConnectError.exit_code
        took = time.monotonic() - started
    finally:
        holder.close()
        server.close()
    assert one_line(capsys).startswith(f"{qmp_path}: another client holds this QMP socket")
    # /proc/net/unix told it: the greeting was waited for HELD_GRACE, not the 5 s timeout.
    assert took < 5.0


def test_a_silent_server_says_what_it_may_be(
    qmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = Server(qmp_path, hello=None)
    try:
        with pytest.raises(ConnectError, match=r"no QMP greeting within 0\.2 s"):
            session.check_socket(qmp_path, timeout=0.2)
    finally:
        server.close()


def test_events_before_the_greeting_are_passed_over(qmp_path: Path) -> None:
    """QEMU can hand a new client the events its previous client's last moments queued, before
    the greeting (seen with two profilers on one VM): still a QMP server."""
    event = b'{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "RESUME"}\r\n'
    server = Server(qmp_path, hello=event + event + GREETING)
    try:
        session.check_socket(qmp_path, timeout=2.0)
    finally:
        server.close()
    assert server.accepted == 1


def test_the_socket_is_told_before_the_kernel_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "kernel.elf"
    bogus.write_text("not an ELF")
    argv = ["--kernel", str(bogus), "--qmp-socket", str(tmp_path / "nope")]
    assert main(argv) == ConnectError.exit_code
    assert one_line(capsys).startswith(f"no QMP socket at {tmp_path / 'nope'}")


# ---- item 4: outputs, checked after the socket and before anything is loaded -------------------


def test_an_output_in_a_missing_folder_fails_before_the_run(
    greeter: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "kernel.elf"
    bogus.write_text("not an ELF")  # not read: the output is told first
    out = tmp_path / "nodir" / "x.svg"
    argv = ["--qmp-socket", str(greeter.path), "-o", str(out), "--kernel", str(bogus)]
    assert main(argv) == OutputError.exit_code
    assert one_line(capsys) == f"cannot write {out}: no folder {out.parent}"
    assert greeter.accepted == 1  # the socket's greeting was read, nothing more


@pytest.mark.parametrize("command", ["profile", "report"])
def test_an_output_with_no_known_extension_lists_them(
    greeter: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    if command == "report":
        argv = ["report", str(tmp_path / "none.qmpprof"), "-o", "x.png"]
        name = "x.png"
    else:
        argv = ["--qmp-socket", str(greeter.path), "-o", "out.html"]
        name = "out.html"
    assert main(argv) == UsageError.exit_code
    line = one_line(capsys)
    assert line.startswith(f"-o {name}: no format has that extension (known: ")
    assert ".svg" in line and ".pb.gz" in line and line.endswith("; or give --format")
    assert not Path(name).exists()


def test_dash_is_standard_output(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    scripted_guest(monkeypatch)
    assert main(["--duration", "0.05", "-o", "-"]) == 0
    captured = capsys.readouterr()
    assert sum(dict(folded.parse(captured.out)).values()) == 10  # 5 ticks x 2 vCPUs
    assert "Wrote the profile on standard output (folded)" in captured.err
    assert list(tmp_path.iterdir()) == []


def test_report_dash_in_a_binary_format(tmp_path: Path) -> None:
    saved = tmp_path / "run.qmpprof"
    fake = [sys.executable, "-c", "from qmpprof.cli import main; import sys; "
            "sys.exit(main(sys.argv[1:]))"]  # fmt: skip
    done = subprocess.run([*fake, "report", str(saved), "-o", "-"], capture_output=True, timeout=60)
    assert done.returncode == 7  # no such profile: the output was fine
    from qmpprof.output import write_profile
    from qmpprof.profile import Profile

    write_profile(Profile(10.0), saved)
    done = subprocess.run(
        [*fake, "report", str(saved), "-o", "-", "--format", "pprof"],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert gzip.decompress(done.stdout)  # pprof is gzipped protobuf, written whole
    assert not (tmp_path / "-").exists() and not Path("-").exists()


# ---- item 6: files, the vCPUs, the command's name, --help -------------------------------------


@pytest.mark.parametrize("flag", ["--kernel", "--kallsyms", "--user-dir"])
def test_a_missing_file_is_the_same_error_for_every_flag(
    greeter: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    missing = tmp_path / "missing"
    assert main(["--qmp-socket", str(greeter.path), flag, str(missing)]) == UsageError.exit_code
    assert one_line(capsys) == f"{flag} {missing}: no such file or directory"


def test_record_checks_outputs_and_files_before_starting_qemu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Were QEMU started, a command that is not there would fail with "command not found".
    out = tmp_path / "nodir" / "x.svg"
    assert main(["record", "-o", str(out), "--", "/nonexistent/qemu"]) == OutputError.exit_code
    assert one_line(capsys) == f"cannot write {out}: no folder {out.parent}"
    missing = tmp_path / "missing"
    argv = ["record", "--kernel", str(missing), "--", "/nonexistent/qemu"]
    assert main(argv) == UsageError.exit_code
    assert one_line(capsys) == f"--kernel {missing}: no such file or directory"


def test_a_vcpu_the_guest_lacks_is_one_line_before_sampling(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    transport = scripted_guest(monkeypatch)  # two vCPUs
    assert main(["--duration", "0.05", "--cpus", "7"]) == UsageError.exit_code
    assert one_line(capsys) == "--cpus: this guest has no vCPU 7 (its vCPUs: 0, 1)"
    assert "stop" not in transport.calls  # never paused


def test_a_misspelt_command_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recrod", "--", "qemu"]) == UsageError.exit_code
    assert one_line(capsys).startswith("unknown command 'recrod': did you mean record?")
    assert main(["frobnicate"]) == UsageError.exit_code
    assert one_line(capsys).startswith("unknown command 'frobnicate' (commands: record, demo")


def test_help_shows_the_commands_and_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(
        "usage: qmpprof [options]\n       qmpprof {record,demo,report,diff,serve,top}"
    )
    assert "(default: ./qmp-socket)" in text and "(default: 10.0)" in text
    assert "(default: 5.0)" in text and "(default: False)" not in text


def test_the_exit_code_table_help_and_the_error_tree_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def tree(cls: type[errors.QmpprofError]) -> Iterator[type[errors.QmpprofError]]:
        yield cls
        for sub in cls.__subclasses__():
            yield from tree(sub)

    codes = {cls.exit_code for cls in tree(errors.QmpprofError)} | {0, 130, 143}
    assert main(["--help"]) == 0
    epilog = " ".join(capsys.readouterr().out.split("Exit codes: ", 1)[1].split())
    helped = {int(code) for code in re.findall(r"(?:^|, |/)(\d+)(?= |/)", epilog)}
    assert codes == documented_codes(), "README's ### Exit codes table"
    assert codes == helped, f"--help: {epilog}"
