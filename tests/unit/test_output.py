"""Every writer against golden files on one hand-built profile, and format choice by file name.

Regenerate the goldens after an intended change with ``QMPPROF_REGEN_GOLDEN=1 pytest
tests/unit/test_output.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from fakes import named_sample

from qmpprof.cli import report
from qmpprof.errors import UsageError
from qmpprof.model import Frame, Mapping, Mode, Process, Sample, Stack
from qmpprof.naming import Naming
from qmpprof.output import EXTENSIONS, FORMATS, folded, format_for, native, render, write_profile
from qmpprof.profile import Profile

GOLDEN = Path(__file__).parents[1] / "golden"
REGENERATE = os.environ.get("QMPPROF_REGEN_GOLDEN") == "1"
GOLDEN_NAMES = {"folded": "profile.folded", "speedscope": "profile.speedscope.json"}

K, U = True, False  # kernel flags, per frame name


def hand_built_profile() -> Profile:
    """Two vCPUs, kernel-only and process samples, recursion, a truncated stack, names that
    need XML escaping, and one sample appended out of time order (the sampler's vCPUs race)."""
    stacks = [
        (0.00, 0, ("kernel", "kmain", "idle_loop"), (U, K, K)),
        (0.01, 0, ("kernel", "kmain", "idle_loop"), (U, K, K)),
        (
            0.02,
            0,
            ("shell (pid 3)", "_start", "main", "read_line", "sys_read_[k]"),
            (U, U, U, U, K),
        ),
        (0.03, 0, ("shell (pid 3)", "_start", "main", 'parse<T>&"x"'), (U, U, U, U)),
        (0.00, 1, ("worker (pid 4)", "_start", "main", "compute", "compute"), (U, U, U, U, U)),
        (0.02, 1, ("kernel", "[truncated]", "page_fault"), (U, U, K)),
        (0.01, 1, ("worker (pid 4)", "_start", "main", "compute"), (U, U, U, U)),
        (0.03, 1, ("worker (pid 4)", "_start", "main", "compute", "compute"), (U, U, U, U, U)),
    ]
    profile = Profile(interval_ms=10.0)
    for t, cpu, names, kernel in stacks:
        profile.add(named_sample(names, t, cpu, kernel))
    profile.facts = {
        "guest": "fixtures/guest/emerald.elf",
        "duration": "0.04 s",
        "samples": "8",
        "rate": "100 Hz",
    }
    return profile


TEXT_FORMATS = sorted(name for name, f in FORMATS.items() if not f.binary)


@pytest.mark.parametrize("fmt", TEXT_FORMATS)
def test_writer_matches_its_golden_file(fmt: str) -> None:
    golden = GOLDEN / GOLDEN_NAMES.get(fmt, f"profile.{fmt}")
    text = render(hand_built_profile(), fmt).decode("utf-8")
    if REGENERATE:
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_writer_is_deterministic_and_keeps_the_profile(fmt: str) -> None:
    profile = hand_built_profile()
    before = (list(profile.times), list(profile.stack_of), list(profile.stacks))
    assert render(profile, fmt) == render(hand_built_profile(), fmt)
    assert (list(profile.times), list(profile.stack_of), list(profile.stacks)) == before


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("out.svg", "svg"),
        ("OUT.SVG", "svg"),
        ("run.speedscope.json", "speedscope"),
        ("run.json", "speedscope"),
        ("run.folded", "folded"),
        ("run.txt", "folded"),
        ("run", "folded"),
        ("run.qmpprof", "qmpprof"),
        ("cpu.pb.gz", "pprof"),
        ("cpu.pprof", "pprof"),
    ],
)
def test_format_follows_the_file_name(name: str, fmt: str) -> None:
    assert format_for(Path(name), None) == fmt


def test_longer_suffixes_come_first() -> None:
    suffixes = [suffix for suffix, _ in EXTENSIONS]
    for i, suffix in enumerate(suffixes):
        assert not any(later.endswith(suffix) for later in suffixes[i + 1 :] if later != suffix)
    assert {fmt for _, fmt in EXTENSIONS} == set(FORMATS)


def test_an_explicit_format_wins_and_an_unknown_one_is_a_usage_error() -> None:
    assert format_for(Path("out.svg"), "speedscope") == "speedscope"
    with pytest.raises(UsageError, match="choose from folded, pprof, qmpprof, speedscope, svg"):
        format_for(Path("out.svg"), "png")


def test_write_profile_writes_the_format_the_name_implies(tmp_path: Path) -> None:
    path = tmp_path / "flame.svg"
    assert write_profile(hand_built_profile(), path) == "svg"
    assert path.read_bytes() == render(hand_built_profile(), "svg", Naming())
    assert [p.name for p in tmp_path.iterdir()] == ["flame.svg"]


VMLINUX = Mapping("vmlinux", 0xFFFF_FFFF_8100_0000, 0xFFFF_FFFF_8300_0000, True)
BURN = Mapping("[qmpprof_burn]", 0xFFFF_FFFF_C000_0000, 0xFFFF_FFFF_C000_4000, True)
SHELL = Mapping("sh", 0x40_0000, 0x50_0000, False, path="/bin/sh")
SCHEDULE = Frame(0xFFFF_FFFF_8100_0010, True, "schedule", 0x10, VMLINUX)
QB_READ = Frame(0xFFFF_FFFF_C000_0010, True, "qb_read", 0x10, BURN)
MAIN = Frame(0x40_1010, False, "main", 0x10, SHELL)
# The rule (docs/formats.md), whatever the context: _[k] on every kernel frame, under the
# kernel root as in a process's stack, a module the name carries named once.
BY_THE_RULE = {"schedule_[k]", "qb_read [qmpprof_burn]_[k]", "main"}
CONTEXTS = {"all", "kernel", "sh (pid 3)"}


def kernel_and_process_profile() -> Profile:
    """A kernel thread in a module's code, and a process in a system call."""
    profile = Profile(interval_ms=10.0)
    shell = Process(3, "sh", 0x1000)
    profile.add(Sample(0.0, 0, Mode.KERNEL, False, 0x1000, Stack((QB_READ, SCHEDULE))))
    profile.add(Sample(0.01, 0, Mode.KERNEL, False, 0x1000, Stack((SCHEDULE, MAIN)), shell))
    return profile


def names_written(fmt: str, data: bytes, tmp_path: Path) -> set[str]:
    """The frame names a file of format ``fmt`` holds; a saved profile's as its report names
    them (qmpprof report to folded)."""
    if FORMATS[fmt].binary:
        saved, out = tmp_path / f"run{FORMATS[fmt].extensions[0]}", tmp_path / "report.folded"
        saved.write_bytes(data)
        assert report.main([str(saved), "-o", str(out)]) == 0
        return names_written("folded", out.read_bytes(), tmp_path)
    text = data.decode()
    if fmt == "folded":
        found = {name for names, _ in folded.parse(text) for name in names}
    elif fmt == "svg":
        found = set(re.findall(r"<title>(.*?) \(\d+ samples", text))
    else:
        found = {frame["name"] for frame in json.loads(text)["shared"]["frames"]}
    return found - CONTEXTS


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_writer_names_kernel_frames_by_one_rule(fmt: str, tmp_path: Path) -> None:
    data = render(kernel_and_process_profile(), fmt)
    assert names_written(fmt, data, tmp_path) == BY_THE_RULE
    if fmt == "pprof":  # pprof's functions are the bare symbols: pprof matches them itself
        pprof_file = tmp_path / "run.pb.gz"
        assert {f.symbol for f in native.load(pprof_file).frames} == {"schedule", "qb_read", "main"}


def test_kernel_module_frames_are_named_function_and_module() -> None:
    from qmpprof.model import Frame, Mapping
    from qmpprof.naming import Naming, frame_name

    module = Mapping("[qmpprof_burn]", 0xFFFF_FFFF_C000_0000, 0xFFFF_FFFF_C000_4000, True)
    image = Mapping("vmlinux", 0xFFFF_FFFF_8100_0000, 0xFFFF_FFFF_8300_0000, True)
    in_module = Frame(0xFFFF_FFFF_C000_0010, True, "qb_read", 0x10, module)
    unnamed = Frame(0xFFFF_FFFF_C000_2000, True, None, 0, module)
    in_image = Frame(0xFFFF_FFFF_8100_0010, True, "schedule", 0x10, image)
    assert frame_name(in_module, Naming()) == "qb_read [qmpprof_burn]_[k]"
    assert frame_name(unnamed, Naming()) == "[unknown] [qmpprof_burn]_[k]"
    assert frame_name(in_image, Naming()) == "schedule_[k]"


def test_a_files_code_no_symbol_covers_is_named_by_its_file() -> None:
    from qmpprof.model import Frame, Mapping
    from qmpprof.naming import Naming, frame_name

    lib = "/rootfs/lib/liblzma.so.5.4.1"
    liblzma = Mapping(
        "liblzma.so.5.4.1", 0x7F00_0000_3000, 0x7F00_0002_0000, False, 0x7F00_0000_0000, lib
    )
    stripped = Frame(0x7F00_0001_F2E0, False, None, 0, liblzma)
    exported = Frame(0x7F00_0000_4010, False, "lzma_code", 0x10, liblzma)
    assert frame_name(stripped, Naming()) == "[unknown] [liblzma.so.5.4.1]"
    assert frame_name(stripped, Naming.of(offsets=True)) == ("[unknown] [liblzma.so.5.4.1+0x1f2e0]")
    assert frame_name(exported, Naming()) == "lzma_code"
    # An anonymous mapping has no file: still one [unknown] bucket.
    assert frame_name(Frame(0x9000, False), Naming()) == "[unknown]"
