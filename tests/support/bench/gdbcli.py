"""gdb used as a profiler, the way people do it: one MI session through pipes, or one
``gdb -batch`` per sample. No pexpect: MI is line-oriented, a result record starts with ``^``,
async records with ``*``, and every answer ends with a ``(gdb)`` prompt line.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import time
from collections.abc import Callable

from qmpprof.errors import GuestGoneError, TransportError

_TIMEOUT = 20.0


class GdbMi:
    """A gdb process under ``--interpreter=mi2`` with the guest's ELF loaded for symbols.
    ``timeout``: how long one answer may take (a subclass with a huge ELF may raise it);
    ``program``: the gdb to run (``gdb-multiarch`` for another architecture than the host's)."""

    timeout = _TIMEOUT
    program = "gdb"

    def __init__(self, elf: str | None) -> None:
        cmd = [self.program, "-nx", "-q", "--interpreter=mi2"] + ([elf] if elf else [])
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        self._buf = b""
        self._attached = True  # close() detaches (interrupting the guest if it runs)
        self._running = False
        self._until(lambda line: line.startswith("(gdb)"))
        # mi-async lets -exec-interrupt be sent while the target runs.
        # A bt that wanders off through garbage would print thousands of frames: cap it.
        for setting in ("mi-async on", "pagination off", "confirm off", "backtrace limit 64"):
            self.command(f"-gdb-set {setting}")

    def _line(self, deadline: float) -> str:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TransportError("gdb did not answer in time")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise GuestGoneError("gdb exited")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\n")
        line = raw.decode(errors="replace").rstrip("\r")
        if line.startswith(("^running", "*running", "*stopped")):
            self._running = not line.startswith("*stopped")  # the target, as gdb last said
        return line

    def _until(self, done: Callable[[str], bool]) -> list[str]:
        deadline = time.monotonic() + self.timeout
        lines = []
        while True:
            line = self._line(deadline)
            lines.append(line)
            if done(line):
                return lines

    def command(self, command: str) -> list[str]:
        """Send one MI command; the lines up to its prompt. ``^error`` raises TransportError."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(command.encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError as err:
            raise GuestGoneError("gdb exited") from err
        lines = self._until(lambda line: line.startswith("^"))
        if lines[-1].startswith("^error"):
            said = " ".join(line[2:-1] for line in lines if line.startswith('&"'))
            raise TransportError(f"gdb: {command}: {lines[-1]} {said}".rstrip())
        return lines + self._until(lambda line: line.startswith("(gdb)"))

    def attach(self, address: str) -> None:
        """Connect to the gdbstub (which stops the guest) and let the guest run again."""
        self.command(f"-target-select remote {address}")
        self.command("-exec-continue")

    def _interrupt(self) -> None:
        # The *stopped record may come before or after the prompt that ends ^done.
        lines = self.command("-exec-interrupt")
        if not any(line.startswith("*stopped") for line in lines):
            self._until(lambda line: line.startswith("*stopped"))

    def interrupt_backtrace_continue(self) -> int:
        """One sample: interrupt, ``bt``, continue. Returns the number of frames gdb printed."""
        self._interrupt()
        lines = self.command('-interpreter-exec console "bt"')
        self.command("-exec-continue")
        return sum(1 for line in lines if line.startswith('~"#'))

    def disconnect(self) -> None:
        """Leave the gdbstub without a word to QEMU: the guest stays as it is (stopped)."""
        self.command("-target-disconnect")
        self._attached = False

    def close(self) -> None:
        """Detach (QEMU resumes the guest) and end gdb; disconnected: end gdb only."""
        try:
            if self._proc.poll() is None:
                if self._attached:
                    if self._running:  # never -exec-interrupt a stopped target: no *stopped
                        self._interrupt()
                    self.command("-target-detach")
                self.command("-gdb-exit")
        except (TransportError, GuestGoneError, BrokenPipeError):
            pass  # gdb is going away either way
        finally:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):  # gdb died: nothing left to flush to
                        pipe.close()


def gdb_batch_backtrace(address: str, elf: str | None) -> int:
    """Run ``gdb -batch`` once: attach, ``bt``, detach. Returns the number of frames printed."""
    cmd = [
        "gdb",
        "-nx",
        "-q",
        "-batch",
        "-ex",
        "set pagination off",
        "-ex",
        "set backtrace limit 64",
    ]
    cmd += ["-ex", f"target remote {address}", "-ex", "bt", "-ex", "detach"]
    cmd += [elf] if elf else []
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as err:
        raise TransportError("gdb -batch did not finish in time") from err
    frames = sum(1 for line in done.stdout.splitlines() if line.startswith(b"#"))
    if done.returncode != 0 or frames == 0:
        tail = done.stderr.decode(errors="replace").strip()[-120:]
        raise TransportError(f"gdb -batch failed ({done.returncode}): {tail}")
    return frames
