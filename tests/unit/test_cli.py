"""The command line through main([...]) with a scripted guest (the fake transport replaces the
QMP connection; the real unwinder walks its frame pointers), and real subprocess runs for the
error paths that need no QEMU."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from fakes import FakeTransport, frame_chain, regs
from guestvm import BUILD_ROOT, build_fixtures
from qemu.qmp import QMPClient

from qmpprof import session
from qmpprof.arch.base import RegisterFormats
from qmpprof.arch.x86 import X86_64
from qmpprof.cli import main, options
from qmpprof.cli import sample as sample_cmd
from qmpprof.errors import GuestGoneError, UsageError
from qmpprof.output import folded
from qmpprof.transport.gdbchannel import read_packet
from qmpprof.transport.qmp import QmpTransport

K = X86_64.kernel_boundary


def scripted_guest(
    monkeypatch: pytest.MonkeyPatch,
    *,
    running: bool = True,
    hook: Callable[[str, int], None] | None = None,
) -> FakeTransport:
    """vCPU 0 in the kernel (two callers deep), vCPU 1 in user space."""
    rbp, pages = frame_chain(K + 0x20_0000, [K + 0x2010, K + 0x1010])
    transport = FakeTransport(
        {0: regs(0, K + 0x3004, rsp=rbp - 64, rbp=rbp), 1: regs(1, 0x40_1000, rsp=rbp, rbp=0)},
        pages,
        running=running,
        hook=hook,
    )

    async def connect(spec: session.RunSpec) -> session.Connection:
        return session.Connection(transport, "a fake")

    monkeypatch.setattr(session, "connect", connect)
    monkeypatch.setattr(session, "check_socket", lambda path: None)  # no QMP to greet here
    return transport


def test_writes_the_output_and_says_where(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    transport = scripted_guest(monkeypatch)
    out = tmp_path / "out.folded"
    assert main(["--duration", "0.05", "--interval", "10", "-o", str(out)]) == 0
    stacks = dict(folded.parse(out.read_text()))
    assert sum(stacks.values()) == 10  # 5 ticks x 2 vCPUs
    # The user vCPU: no metadata page, no user ELFs: its address space is named by CR3.
    assert stacks[("cr3=0x1000", "[unknown]")] == 5
    captured = capsys.readouterr()
    assert captured.out == ""
    no_kernel, sampling = captured.err.splitlines()[:2]
    assert no_kernel == f"qmpprof: note: {session.NO_KERNEL}"  # no --kernel given
    assert sampling.startswith("qmpprof: sampling qmp-socket every 10 ms for 0.05 s")
    assert "Samples: 10  Errors: 0" in captured.err
    assert f"Wrote {out} (folded); view it: flamegraph.pl {out}" in captured.err
    assert "\r" not in captured.err  # no progress line when stderr is not a terminal
    assert transport.calls.count("stop") == 5 and transport.calls[-1] == "cont"


def test_an_output_that_cannot_be_written_is_one_line_and_the_others_are_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()  # there when the outputs are checked, removed while sampling

    def remove(what: str, cpu: int) -> None:
        if gone.exists():
            gone.rmdir()

    transport = scripted_guest(monkeypatch, hook=remove)
    good, bad = tmp_path / "good.folded", gone / "bad.svg"
    assert main(["--duration", "0.05", "-o", str(bad), "-o", str(good)]) == 8
    assert sum(c for _, c in folded.parse(good.read_text())) == 10
    err = capsys.readouterr().err
    assert f"Wrote {good} (folded)" in err
    assert err.splitlines()[-1] == (
        f"qmpprof: error: cannot write {bad}: No such file or directory"
    )
    assert "Traceback" not in err and transport.calls[-1] == "cont"


def test_prints_top_stacks_without_output(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scripted_guest(monkeypatch)
    assert main(["--duration", "0.03", "--cpus", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Top 1 of 1 stacks (3 samples), root first:")
    assert "100.0%  cr3=0x1000;[unknown]" in out


@pytest.mark.parametrize(("flag", "kept", "filtered"), [("-k", 2, 2), ("--user-only", 2, 2)])
def test_mode_filters_report_filtered_apart(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    kept: int,
    filtered: int,
) -> None:
    scripted_guest(monkeypatch)
    assert main(["--duration", "0.02", flag]) == 0
    err = capsys.readouterr().err
    assert f"Samples: {kept}  Errors: 0  Truncated: 0  Filtered: {filtered}" in err


def test_one_shot_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    transport = scripted_guest(monkeypatch)
    assert main(["--one-shot", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["cpu"], s["mode"], s["user"], s["space"]) for s in doc] == [
        (0, "kernel", False, "0x1000"),
        (1, "user", True, "0x1000"),
    ]
    # Hex strings: kernel addresses are beyond what a JSON number holds exactly (2**53).
    addresses = [int(f["address"], 16) for f in doc[0]["frames"]]
    assert addresses == [K + 0x3004, K + 0x2010, K + 0x1010]
    assert set(doc[0]["frames"][0]) == {
        "address", "symbol", "offset", "module", "kernel", "inlined", "tail_call"
    }  # fmt: skip
    assert doc[0]["process"] is None
    assert (transport.calls.count("stop"), transport.calls.count("cont")) == (1, 1)


def test_paused_guest_stays_paused_and_its_stacks_are_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    transport = scripted_guest(monkeypatch, running=False)
    assert main(["--duration", "1", "--show-addresses"]) == 0
    captured = capsys.readouterr()
    assert "the guest is paused: took one sample without resuming it" in captured.err
    assert captured.out.splitlines()[:2] == [
        "vCPU 0: kernel (CPU in kernel mode, page tables 0x1000)",
        f"  #0  {K + 0x3004:#018x} [unknown]_[k]",
    ]
    assert "stop" not in transport.calls and "cont" not in transport.calls
    assert not transport.running


def test_qemu_gone_mid_run_keeps_the_samples(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def hook(name: str, stops: int) -> None:
        if name == "stop" and stops == 3:
            raise GuestGoneError("QEMU closed the QMP connection")

    scripted_guest(monkeypatch, hook=hook)
    out = tmp_path / "partial.folded"
    assert main(["--duration", "1", "-o", str(out)]) == 4
    assert sum(c for _, c in folded.parse(out.read_text())) == 6
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"qmpprof: error: QEMU closed the QMP connection; the samples collected so far are in {out}"
    )
    assert any(line.startswith(f"Wrote {out}") for line in err)


class _Gone:
    """A QMP client whose QEMU went away."""

    async def execute(self, cmd: str, args: object = None) -> object:
        raise EOFError


async def test_the_readme_quotes_what_qmpprof_says_when_qemu_goes_away() -> None:
    """Each transport's own message, as the sampler ends a run with it, is in the README."""
    client, formats = cast(QMPClient, _Gone()), cast(RegisterFormats, None)
    with pytest.raises(GuestGoneError) as over_qmp:
        await QmpTransport(client, "memsave", False, formats, "qmp.sock").status()
    reader = asyncio.StreamReader()
    reader.feed_eof()
    with pytest.raises(GuestGoneError) as over_gdbstub:
        await read_packet(reader)
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    for gone in (over_gdbstub.value, over_qmp.value):
        line = f"qmpprof: error: {gone}; the samples collected so far are in FILE"
        assert f"`{line}`" in readme, line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--interval", "0"], "--interval must be from 0.1 to 10 ms"),
        (["--duration", "-1"], "--duration must be more than 0"),
        (["--cpus", "1-x"], "--cpus: not a vCPU list"),
        (["--cpus", "3-1"], "--cpus: bad range"),
        (["--kernel-boundary", "zz"], "--kernel-boundary: not an address"),
        (["--qmp", "host"], "not HOST:PORT"),
        (["--json"], "--json needs --one-shot"),
        (["--off-cpu"], "--off-cpu needs a guest OS that tells its tasks"),
        (["--one-shot", "--off-cpu"], "--off-cpu needs a guest OS that tells its tasks"),
        (["-k", "-u"], "not allowed with argument"),
        (["--jitter", "2"], "--jitter must be a fraction"),
        (["--transport", "gdb"], "--transport gdb needs --gdb"),
        (["--gdb", "h:1", "--transport", "qmp"], "--gdb needs --transport gdb"),
        (["--connect", "qemu:///system"], "--connect needs --domain NAME"),
        (["--os", "linux"], "--os linux needs --kernel"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--format", "pdf", "-o", "x.pdf"], "unknown format 'pdf'"),
    ],
)
def test_bad_values_are_one_line_usage_errors(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    scripted_guest(monkeypatch)
    assert main(["--duration", "0.01", *argv]) == UsageError.exit_code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qmpprof: error: ") and message in err


def test_cpu_lists_and_addresses() -> None:
    assert options.parse_cpus("0,2-3, 5") == (0, 2, 3, 5)
    assert options.parse_address("0xffff_ffff_8000_0000", "--kernel-boundary") == K
    assert options.parse_host_port(":4444") == ("localhost", 4444)
    spec = options.parse([]).spec
    sampling = spec.sampling
    assert (sampling.interval, sampling.duration, spec.reach.qmp_socket) == (
        0.01,
        5.0,
        Path("qmp-socket"),
    )
    assert sampling.kernel_boundary is None and sampling.keep is None and sampling.cpus is None


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmpprof", *args], capture_output=True, text=True, timeout=60
    )


def test_subprocess_missing_socket(tmp_path: Path) -> None:
    result = run_cli("--qmp-socket", str(tmp_path / "nope"))
    assert result.returncode == 3
    assert result.stderr == f"qmpprof: error: no QMP socket at {tmp_path / 'nope'}" + (
        " (is QEMU running with -qmp unix:...?)\n"
    )


def test_subprocess_unreadable_kernel_elf(tmp_path: Path) -> None:
    bogus = tmp_path / "kernel.elf"
    bogus.write_text("not an ELF")
    # --gdb: no QMP socket to check before the files
    result = run_cli("--kernel", str(bogus), "--gdb", "127.0.0.1:1")
    assert result.returncode == 6
    assert result.stderr == f"qmpprof: error: {bogus}: not a usable ELF file: no ELF magic\n"


def test_subprocess_bad_flag_has_no_traceback() -> None:
    result = run_cli("--interval", "ten")
    assert result.returncode == 2
    assert result.stderr == "qmpprof: error: argument --interval: invalid float value: 'ten'\n"


def test_second_interrupt_cancels_a_hung_run_and_still_resumes_and_writes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    class Hung(FakeTransport):
        async def read(self, cpu: int, addr: int, size: int) -> bytes:
            if self.stops < 3:
                return await super().read(cpu, addr, size)
            os.kill(os.getpid(), signal.SIGINT)  # the first asks for a clean stop...
            os.kill(os.getpid(), signal.SIGINT)  # ...the second gives up waiting on QEMU
            await asyncio.Event().wait()
            raise AssertionError

    rbp, pages = frame_chain(K + 0x20_0000, [K + 0x2010])
    transport = Hung({0: regs(0, K + 0x3004, rsp=rbp, rbp=rbp)}, pages)

    async def connect(spec: session.RunSpec) -> session.Connection:
        return session.Connection(transport, "a fake")

    monkeypatch.setattr(session, "connect", connect)
    monkeypatch.setattr(session, "check_socket", lambda path: None)  # no QMP to greet here
    out = tmp_path / "hung.folded"
    assert main(["--duration", "10", "-o", str(out)]) == 130
    assert transport.calls[-1] == "cont" and transport.running
    assert sum(c for _, c in folded.parse(out.read_text())) == 2
    assert capsys.readouterr().err.endswith("qmpprof: interrupted by SIGINT\n")


def test_progress_line_only_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scripted_guest(monkeypatch)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(sample_cmd, "_PROGRESS_EVERY", 0.0)
    assert main(["--duration", "0.03", "--cpus", "0"]) == 0
    err = capsys.readouterr().err
    assert "\rqmpprof: 1 samples" in err and "\rqmpprof: 3 samples" in err
    assert " s left" in err and "\r\033[K" in err  # cleared before the summary


def test_the_kernel_boundary_follows_the_kernel_elf_class(guest_build_i386: Path) -> None:
    kernel = str(guest_build_i386 / "kernel.elf")
    given = options.parse(["--kernel", kernel, "--kernel-boundary", "0x80000000"])
    assert given.spec.sampling.kernel_boundary == 0x8000_0000
    assert options.parse([]).spec.sampling.kernel_boundary is None  # the instruction set's
    spec = options.parse(["--kernel", kernel, "--user-dir", str(guest_build_i386 / "user")]).spec
    guest = session.load(spec)
    assert type(guest).__name__ == "Cr3Identifier"  # no Emerald page on a 32-bit kernel
    unwinder = session.unwinder(spec, guest)
    assert unwinder.arch.name == "i386" and unwinder.kernel_boundary == 0xC000_0000
    x86_64 = session.load(options.parse([]).spec)
    assert session.unwinder(options.parse([]).spec, x86_64).kernel_boundary == K


@pytest.fixture
def guest_build_i386() -> Path:
    build_fixtures(("i386",))
    return BUILD_ROOT / "i386"
