"""Run the teaching-kernel-shaped guests (fixtures/hobby, i386; fixtures/hobby64, x86_64;
fixtures/hobbyrs, x86_64 in Rust) for tests.

``running_hobby`` boots one on SMP (two) vCPUs with a QMP socket (and a gdbstub on
``gdb_port`` for the oracle), waits until every CPU and every user program said it runs, and
kills QEMU whatever happens. The guest is a ``Guest`` of tests/guestvm.py (variant: the
build's name), so its oracles (gdb_backtrace, ...) apply. ``every_hobby`` runs a test on
each build (``hobby``: a ``Hobby``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from guestvm import (
    BOOT_TIMEOUT,
    BUILD_ROOT,
    ROOT,
    Guest,
    _die_with_parent,
    _wait_qmp,
    build_fixtures,
    wait_console,
)

SMP = 2


@dataclass(frozen=True)
class Names:
    """How gdb (in C) names a build's CPUs, processes, their count and its trap frame's type;
    the kernel's 32-bit integer type (a description's cast names it); the namespace of its
    functions in gdb's names (a Rust crate's: ``#[no_mangle]`` ones are named plain by their
    symbols)."""

    cpus: str
    procs: str
    ncpu: str
    trapframe: str
    integer: str = "int"
    namespace: str = ""


@dataclass(frozen=True)
class Hobby:
    """One build of the guest: its sources in fixtures/``name`` (built in fixtures/build/
    ``name``), the QEMU that boots it, where its kernel's link address puts the kernel/user
    boundary (kernel.ld), its ``KERNBASE`` (kernel virtual = physical + KERNBASE), the trap
    frame's pc member and the context's, the frame pointer's name, a word's size, where the
    trap frame is at the entry's ``call trap`` (``{tf}``: its type; i386: the argument on the
    stack, x86_64: in rdi) and how many instructions the timer's and the system call's vector
    stubs and ``alltraps`` run up to that call, the call included. ``names``: how gdb (in C,
    ``set language c``) names the kernel's CPUs, processes, their count and the trap frame's
    type: C's globals, or rustc's statics quoted whole."""

    arch: str
    name: str
    qemu: str
    boundary: int
    kernbase: int
    pc: str
    fp: str
    word: int
    tf_at_call: str
    entry_steps: int
    names: Names = Names("cpus", "procs", "ncpu", "struct trapframe")

    @property
    def build_dir(self) -> Path:
        return BUILD_ROOT / self.name

    @property
    def description(self) -> Path:
        """The kernel description shipped beside its sources (--describe)."""
        return ROOT / "fixtures" / self.name / "describe.toml"

    @property
    def running_lines(self) -> tuple[str, ...]:
        """What the kernel prints once every CPU runs (main), and each user program once it
        runs (fixtures/hobby/user/*.c)."""
        return (
            f"{self.name}: scheduler running on {SMP} cpus",
            "crunch: running",
            "chatter: running",
        )

    def function(self, name: str) -> str:
        """A kernel function as gdb (in C) names it."""
        return f"'{self.names.namespace}{name}'" if self.names.namespace else name

    @property
    def trap_frame(self) -> str:
        """The trap frame's address at the entry's call of the handler, as gdb reads it."""
        return self.tf_at_call.format(tf=self.names.trapframe)


RUST_NAMES = Names(
    "'hobbyrs::CPUS'", "'hobbyrs::PROCS'", "'hobbyrs::NCPUS'", "'hobbyrs::TrapFrame'", "i32",
    "hobbyrs::",
)  # fmt: skip
# Entry steps: each stub's push(es) and jmp; alltraps' pushes, moves and call (i386: 10; x86_64:
# 15 pushes, the move of rsp to rdi, the call).
HOBBY_I386 = Hobby(
    "i386", "hobby", "qemu-system-i386", 0x8010_0000, 0x8000_0000, "eip", "ebp", 4,
    "(*({tf} **)$esp)", 3 + 3 + 10,
)  # fmt: skip
HOBBY_X86_64 = Hobby(
    "x86_64", "hobby64", "qemu-system-x86_64", 0x4010_0000, 0x4000_0000, "rip", "rbp", 8,
    "(({tf} *)$rdi)", 3 + 3 + 17,
)  # fmt: skip
# The x86_64 kernel in Rust: hobby64's boot and entry code, its own Rust.
HOBBY_RUST = Hobby(
    "rust", "hobbyrs", "qemu-system-x86_64", 0x4010_0000, 0x4000_0000, "rip", "rbp", 8,
    "(({tf} *)$rdi)", 3 + 3 + 17, RUST_NAMES,
)  # fmt: skip
HOBBIES = (HOBBY_I386, HOBBY_X86_64, HOBBY_RUST)
every_hobby = pytest.mark.parametrize("hobby", HOBBIES, ids=[h.arch for h in HOBBIES])


@contextlib.contextmanager
def running_hobby(
    tmp_path: Path, hobby: Hobby = HOBBY_I386, *, gdb_port: int | None = None
) -> Iterator[Guest]:
    """Boot ``hobby`` on its QEMU first on PATH, on SMP vCPUs, and yield it once QMP accepts
    connections, every CPU runs and its programs run."""
    build_fixtures((hobby.name,))
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    sock_dir = Path(tempfile.mkdtemp(prefix="qh-", dir="/tmp"))
    console = tmp_path / f"console-{hobby.name}-{time.monotonic_ns()}.txt"
    cmd = [
        hobby.qemu, "-kernel", str(hobby.build_dir / "kernel.elf"),
        "-accel", "tcg", "-smp", str(SMP), "-m", "64M",
        "-display", "none", "-no-reboot", "-monitor", "none",
        "-qmp", f"unix:{sock_dir / 'qmp.sock'},server=on,wait=off",
        "-serial", f"file:{console}",
    ]  # fmt: skip
    if gdb_port is not None:
        cmd += ["-gdb", f"tcp:127.0.0.1:{gdb_port}"]
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    guest = Guest(
        qmp_socket=sock_dir / "qmp.sock",
        console=console,
        variant=hobby.name,
        smp=SMP,
        build_dir=hobby.build_dir,
        process=process,
        gdb_port=gdb_port,
    )
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT
        _wait_qmp(guest, deadline)
        for line in hobby.running_lines:
            wait_console(guest, line, max(deadline - time.monotonic(), 0.1))
        yield guest
    finally:
        process.kill()
        process.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(console)
