"""The saved profile (.qmpprof): a round trip keeps every frame, stack, sample and fact, so any
naming renders the same from the file as from the run; bad files are one-line errors."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import named_sample
from test_output import hand_built_profile

from qmpprof.errors import ProfileError
from qmpprof.model import Frame, Mapping, Mode, Process, Sample, Stack, StopReason
from qmpprof.naming import Detail, Naming
from qmpprof.output import native, render
from qmpprof.profile import Profile

KERNEL = Mapping("vmlinux", 0xFFFF_FFFF_8100_0000, 0xFFFF_FFFF_8200_0000, True, 0x1000,
                 "/boot/vmlinux", "ab12", 0x1000)  # fmt: skip
NAMINGS = [
    Naming(),
    Naming(Detail.OFFSET),
    Naming(Detail.LINE),
    Naming(Detail.FUNCTION, show_addresses=True),
]


def detailed_profile() -> Profile:
    """Frames with mappings, offsets, lines and an inlined frame; kernel and user samples."""
    leaf_inlined = Frame(KERNEL.start + 0x10, True, "helper", 0, KERNEL, "lib.c", 7, inlined=True)
    leaf = Frame(KERNEL.start + 0x10, True, "do_work", 0x10, KERNEL, "work.c", 42)
    caller = Frame(KERNEL.start + 0x205, True, "syscall_entry", 0x5, KERNEL, "entry.S", 3)
    user = Frame(0x401234, False, "main", 0x34)
    profile = Profile(2.0, {"guest": "test", "samples": "3"})
    shell = Process(3, "shell", 0xA000)
    stack = Stack((leaf_inlined, leaf, caller, user))
    profile.add(Sample(0.002, 0, Mode.KERNEL, 0, 0xA000, stack, shell))
    profile.add(Sample(0.004, 1, Mode.USER, 3, 0xA000, Stack((user,)), shell))
    profile.add(Sample(0.006, 0, Mode.KERNEL, 0, 0, Stack((caller,), StopReason.DEPTH), None))
    return profile


@pytest.mark.parametrize("naming", NAMINGS, ids=lambda n: f"{n.detail.value}{n.show_addresses}")
@pytest.mark.parametrize("build", [hand_built_profile, detailed_profile])
def test_round_trip_renders_the_same_in_every_naming(
    tmp_path: Path, naming: Naming, build: object
) -> None:
    assert callable(build)
    profile = build()
    path = tmp_path / "run.qmpprof"
    path.write_bytes(render(profile, "qmpprof"))
    again = native.load(path)
    assert again.named_counts(naming) == profile.named_counts(naming)
    assert list(again.timeline()) == list(profile.timeline())
    assert again.frames == profile.frames and again.facts == profile.facts
    for fmt in ("folded", "speedscope", "svg"):
        assert render(again, fmt, naming) == render(profile, fmt, naming)


def test_naming_modes_show_what_the_frames_hold() -> None:
    profile = detailed_profile()
    plain = profile.named_counts(Naming())
    assert ("shell (pid 3)", "main", "syscall_entry_[k]", "do_work_[k]") in plain
    lines = profile.named_counts(Naming(Detail.LINE))
    assert (
        "shell (pid 3)", "main", "syscall_entry (entry.S:3)_[k]", "do_work (work.c:42)_[k]",
        "helper (lib.c:7)_[i]_[k]",
    ) in lines  # fmt: skip
    offsets = profile.named_counts(Naming(Detail.OFFSET))
    assert ("kernel", "[truncated]", "syscall_entry+0x5_[k]") in offsets
    assert sum(plain.values()) == sum(lines.values()) == sum(offsets.values()) == 3


def test_identical_samples_are_stored_once() -> None:
    profile = Profile()
    for i in range(5000):
        profile.add(named_sample(("kernel", "kmain", "idle_loop"), i / 1000, cpu=i % 2))
    assert len(profile) == 5000 and len(profile.stacks) == 1 and len(profile.frames) == 2
    per_sample = sum(a.itemsize for a in (profile.times, profile.cpus_of, profile.stack_of))
    assert per_sample <= 16
    assert profile.counts == [5000]


def test_select_keeps_a_mode_and_vcpus() -> None:
    profile = detailed_profile()
    kernel = profile.select(Mode.KERNEL)
    assert len(kernel) == 2
    assert ("shell (pid 3)", "syscall_entry_[k]", "do_work_[k]") in kernel.named_counts(Naming())
    assert len(profile.select(cpus=[1])) == 1 and len(profile.select(Mode.USER, [0])) == 0


def write_gz(path: Path, doc: object) -> Path:
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not gzip", "not gzipped JSON"),
        (gzip.compress(b"{", mtime=0), "not gzipped JSON"),
        (gzip.compress(b'{"kind": "other"}', mtime=0), "no qmpprof profile header"),
        (gzip.compress(b'{"kind": "qmpprof-profile", "version": 9}', mtime=0), "version 9"),
        (gzip.compress(b'{"kind": "qmpprof-profile", "version": 1}', mtime=0), "malformed"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.qmpprof"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match=message) as caught:
        native.load(path)
    assert "\n" not in str(caught.value) and caught.value.exit_code == 7


def test_a_sample_pointing_at_no_stack_is_malformed(tmp_path: Path) -> None:
    doc = json.loads(gzip.decompress(render(detailed_profile(), "qmpprof")))
    doc["samples"]["stack"][0] = 99
    with pytest.raises(ProfileError, match="malformed"):
        native.load(write_gz(tmp_path / "x.qmpprof", doc))


def test_a_missing_file_is_a_profile_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="No such file"):
        native.load(tmp_path / "missing.qmpprof")


def test_a_mapping_without_a_file_offset_reads_as_offset_0(tmp_path: Path) -> None:
    doc = json.loads(gzip.decompress(render(detailed_profile(), "qmpprof")))
    doc["mappings"] = [m[:7] for m in doc["mappings"]]  # as files before file offsets
    again = native.load(write_gz(tmp_path / "old.qmpprof", doc))
    assert {f.module for f in again.frames if f.module} == {replace(KERNEL, file_offset=0)}


def threaded_profile() -> Profile:
    """Two threads of one Linux process: two Process values, one label."""
    profile = Profile(10.0)
    user = Frame(0x401234, False, "main", 0x34)
    for tid, thread in ((40, "app"), (41, "app-worker")):
        process = Process(40, "app", 0, tid, thread)
        profile.add(Sample(0.01 * tid, 0, Mode.USER, 3, 0, Stack((user,)), process))
    return profile


def test_threads_are_kept_and_files_without_them_still_load(tmp_path: Path) -> None:
    profile = threaded_profile()
    again = native.load(write_gz(tmp_path / "t.qmpprof", json.loads(gzip.decompress(
        render(profile, "qmpprof")))))  # fmt: skip
    threads = {(s.process.tid, s.process.thread) for s in again.stacks if s.process}
    assert threads == {(40, "app"), (41, "app-worker")}
    assert again.named_counts(Naming()) == {("app (pid 40)", "main"): 2}  # one process
    doc = json.loads(gzip.decompress(render(profile, "qmpprof")))
    doc["processes"] = [p[:3] for p in doc["processes"]]  # as files before threads
    old = native.load(write_gz(tmp_path / "old.qmpprof", doc))
    # Files from before processes had threads (and their space a name) came from x86 guests.
    assert {s.process for s in old.stacks} == {Process(40, "app", 0, space_name="cr3")}


def test_a_version_1_file_written_by_hand_still_loads(tmp_path: Path) -> None:
    doc = {
        "kind": "qmpprof-profile",
        "version": 1,  # before stacks could hold a task's state
        "interval_ms": 10.0,
        "facts": {"guest": "old"},
        "mappings": [],
        # pid, program, space, tid, thread, space name
        "processes": [[40, "app", "0x0", 40, "app", "cr3"]],
        # pc, kernel, symbol, offset, mapping (-1: none), file, line, inlined
        "frames": [["0x401234", False, "main", 0x34, -1, None, None, False]],
        # process, mode, how the walk ended, frame ids leaf first: four fields
        "stacks": [[0, "user", "end", [0]]],
        "samples": {"time": [0.01, 0.02], "cpu": [0, 1], "stack": [0, 0]},
    }
    again = native.load(write_gz(tmp_path / "v1.qmpprof", doc))
    assert again.named_counts(Naming()) == {("app (pid 40)", "main"): 2}
    assert [s.state for s in again.stacks] == [None] and list(again.cpus_of) == [0, 1]
    written = json.loads(gzip.decompress(render(again, "qmpprof")))
    assert written["version"] == native.VERSION == 2


SPACED = {"a b": ['x " y\\', "\\\\", 'q\\"', "\\\\\\ ", 1.5, {"  k ": " v\t "}], "é": [" "] * 3}


def test_white_space_is_taken_out_of_json_wherever_its_pieces_are_cut() -> None:
    """Indented JSON whose strings hold spaces, a tab, quotes and runs of backslashes, cut into
    two pieces at every byte and three at every fourth: squeezed, it is always the compact text
    (nothing of a string lost, nothing between values kept)."""
    text = json.dumps(SPACED, indent=3, ensure_ascii=False).encode()
    compact = json.dumps(SPACED, separators=(",", ":"), ensure_ascii=False).encode()
    cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1, 4)]
    for i, j in cuts:
        squeeze = native._Squeeze()
        pieces = [squeeze.feed(p) for p in (text[:i], text[i:j], text[j:])]
        assert b"".join(pieces) + squeeze.held == compact, (i, j)
