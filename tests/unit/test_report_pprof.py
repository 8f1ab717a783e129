"""``qmpprof report`` and ``qmpprof diff`` read pprof: a run-like profile read back names every
frame as its .qmpprof does; a minimal pprof written by hand reads as far as it carries; damage
is one line (a real run: tests/e2e/test_report_pprof_go.py)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from protowire import Message

from qmpprof.cli import main
from qmpprof.cli.text import top_stacks
from qmpprof.model import Frame, Mapping, Mode, Process, Sample, Stack, StopReason
from qmpprof.naming import Detail, Naming
from qmpprof.output import native, render
from qmpprof.output.facts import BOUNDARY_KEY
from qmpprof.profile import Profile

KERNEL = 0xFFFF_FFFF_8100_0000
VMLINUX = Mapping("vmlinux", KERNEL, KERNEL + (16 << 20), True, 0, "/boot/vmlinuz", "ab12", 0)
MODULE = Mapping("[burn]", 0xFFFF_FFFF_C000_0000, 0xFFFF_FFFF_C001_0000, True)
SHELL = Mapping("shell", 0x40_0000, 0x41_0000, False, 0, "/usr/bin/shell", None, 0x1000)
LIBC = Mapping("libc.so.6", 0x7F00_0000_0000, 0x7F00_0010_0000, False, 0, "/lib/libc.so.6")
RANGE = Mapping("[unknown]", 0x50_0000, 0x60_0000, False)


def run_like_profile() -> Profile:
    """What a run holds: kernel and process samples, a kernel module, inlined frames with
    lines, code no symbol covers (in a file, in a range), threads, a truncated walk."""
    shell = Process(3, "shell", 0, 4, "worker")
    spin = Process(None, "spin", 0x123_4000, space_name="cr3")
    main = Frame(0x40_1030, False, "main", 0x30, SHELL, "shell.c", 12)
    stacks = [
        (0, Mode.KERNEL, None, StopReason.END,
         [Frame(KERNEL + 0x10, True, "idle", 0x10, VMLINUX),
          Frame(KERNEL + 0x100, True, "start_kernel", 0x20, VMLINUX, "init/main.c", 9)]),
        (1, Mode.USER, shell, StopReason.END,
         [Frame(0x7F00_0000_0500, False, None, 0, LIBC),
          Frame(0x40_1020, False, "helper", 0, SHELL, "h.h", 3, inlined=True),
          Frame(0x40_1020, False, "run", 0x20, SHELL, "shell.c", 20), main]),
        (1, Mode.KERNEL, shell, StopReason.NO_CFI,
         [Frame(0xFFFF_FFFF_C000_0100, True, "burn_fn", 0x100, MODULE),
          Frame(KERNEL + 0x200, True, "sys_write", 0, VMLINUX), main]),
        (0, Mode.USER, spin, StopReason.END, [Frame(0x50_1000, False, None, 0, RANGE)]),
    ]  # fmt: skip
    profile = Profile(5.0, {"guest": "test", "samples": "9"})
    for i in range(9):
        cpu, mode, process, stop, frames = stacks[i % len(stacks)]
        sample = Sample(
            i * 0.005, cpu, mode, mode is Mode.USER, 0, Stack(tuple(frames), stop), process
        )
        profile.add(sample)
    return profile


@pytest.mark.parametrize("naming", [Naming(), Naming(Detail.LINE), Naming(show_addresses=True)])
@pytest.mark.parametrize("keep", [None, Mode.KERNEL, Mode.USER])
def test_a_run_read_back_from_pprof_names_every_frame_as_its_qmpprof(
    naming: Naming, keep: Mode | None, tmp_path: Path
) -> None:
    profile = run_like_profile()
    path = tmp_path / "run.pb.gz"
    path.write_bytes(render(profile, "pprof"))
    back = native.load(path)
    assert back.facts == profile.facts and back.interval_ms == profile.interval_ms
    if keep is not None:
        profile, back = profile.select(keep), back.select(keep)
    assert back.named_counts(naming) == profile.named_counts(naming)
    assert top_stacks(back, naming) == top_stacks(profile, naming)
    assert render(back, "folded", naming) == render(profile, "folded", naming)


def hand_built_pprof() -> bytes:
    """Two stacks of one sample type, no labels, no mappings: what another tool may write."""
    strings = ["", "samples", "count", "main", "work", "app.c"]
    root = Message().message(1, Message().u64(1, 1).u64(2, 2))
    root.message(2, Message().packed(1, [2, 1]).packed(2, [3]))
    root.message(2, Message().packed(1, [1]).packed(2, [1]))
    root.message(4, Message().u64(1, 1).u64(3, 0x401000).message(4, Message().u64(1, 1)))
    root.message(4, Message().u64(1, 2).u64(3, 0x401100).message(4, Message().u64(1, 2)))
    root.message(5, Message().u64(1, 1).u64(2, 3).u64(4, 5))
    root.message(5, Message().u64(1, 2).u64(2, 4).u64(4, 5))
    for text in strings:
        root.string(6, text)
    return gzip.compress(root.encode())


def test_a_pprof_from_elsewhere_reads_as_far_as_it_carries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.pb.gz"
    path.write_bytes(hand_built_pprof())
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Top 2 of 2 stacks (4 samples)")
    assert "kernel;main;work" in out and "kernel;main\n" in out


@pytest.mark.parametrize(
    "data",
    [
        gzip.compress(b"\x0a\x05\x08", mtime=0),
        gzip.compress(b"\xff" * 12, mtime=0),
        gzip.compress(b"\x12", mtime=0),
    ],
)
def test_damaged_pprof_is_one_line(
    data: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.pb.gz"
    path.write_bytes(data)
    assert main(["report", str(path)]) == 7
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a pprof profile either" in err


def teaching_kernel_profile(facts: dict[str, str]) -> Profile:
    """An i386 teaching kernel linked at 0x80100000 (below the usual 0xc0000000 split) under a
    program linked at 0: a system call's stack, kernel frames over the program's."""
    kernel = Mapping("kernel.elf", 0x8010_0000, 0x8020_0000, True, 0, "/k/kernel.elf")
    program = Mapping("crunch", 0, 0x2000, False, 0, "/u/crunch")
    frames = (
        Frame(0x8010_1234, True, "sys_write", 0x34, kernel),
        Frame(0x8010_2000, True, "trap", 0x10, kernel),
        Frame(0x0_0456, False, "main", 0x56, program),
    )
    profile = Profile(10.0, facts)
    stack = Stack(frames, StopReason.END)
    profile.add(Sample(0.0, 0, Mode.KERNEL, False, 0, stack, Process(1, "crunch", 0x2000)))
    return profile


@pytest.mark.parametrize(
    ("written", "kernel"),
    [
        ("0x80100000", [True, True, False]),  # the run's own boundary
        (None, [False, False, False]),  # no fact (serve's older pprof): the 32-bit half
        ("0xzz", [False, False, False]),  # damaged: the same
    ],
)
def test_kernel_frames_are_told_by_the_runs_own_boundary(
    written: str | None, kernel: list[bool], tmp_path: Path
) -> None:
    facts = {"guest": "hobby"} | ({} if written is None else {BOUNDARY_KEY: written})
    path = tmp_path / "run.pb.gz"
    path.write_bytes(render(teaching_kernel_profile(facts), "pprof"))
    back = native.load(path)
    (record,) = back.stacks
    assert [f.kernel for f in back.frames_of(record)] == kernel
    kept = back.select(Mode.KERNEL)
    assert [f.kernel for f in kept.frames_of(kept.stacks[0])] == [k for k in kernel if k]
