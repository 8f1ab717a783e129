"""pprof output: the profile.proto message read back with a tiny protobuf reader, and Go's own
``go tool pprof`` reading hand-built files (-raw, -top; a real run:
tests/e2e/test_pprof_go_tool.py)."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

from gopprof import decode, go_pprof, one, packed, sub, top_flat
from test_output import hand_built_profile
from test_output_native import KERNEL, detailed_profile, threaded_profile

from qmpprof.model import Frame, Mapping, Mode, Process, Sample, Stack, StopReason
from qmpprof.naming import KERNEL_SUFFIX, Naming
from qmpprof.output import folded, pprofread, render
from qmpprof.profile import Profile


def test_the_profile_message_holds_types_period_mappings_and_comments() -> None:
    got = decode(render(detailed_profile(), "pprof"))
    assert got.strings[0] == ""
    types = [(got.strings[one(sub(t), 1)], got.strings[one(sub(t), 2)]) for t in got.root[1]]
    assert types == [("samples", "count"), ("cpu", "nanoseconds")]
    period_type = sub(got.root[11][0])
    assert (got.strings[one(period_type, 1)], one(got.root, 12)) == ("cpu", 2_000_000)
    (comments,) = got.root[13]  # a packed repeated int64, as proto3 writes it
    assert isinstance(comments, bytes)
    assert [got.strings[c] for c in packed(comments)] == [
        "guest: test",
        "samples: 3",
    ]
    (mapping,) = got.mappings.values()
    assert (one(mapping, 2), one(mapping, 3), one(mapping, 4)) == (
        KERNEL.start,
        KERNEL.end,
        KERNEL.file_offset,
    )
    assert got.strings[one(mapping, 5)] == "/boot/vmlinux"
    assert got.strings[one(mapping, 6)] == "ab12"
    assert [one(mapping, n) for n in (7, 8, 9, 10)] == [1, 1, 1, 1]


def test_inlined_frames_are_lines_of_one_location_innermost_first() -> None:
    got = decode(render(detailed_profile(), "pprof"))
    locations, values, labels = got.samples[0]
    assert values == [1, 2_000_000]
    mapping, address, lines = got.locations[locations[0]]
    assert address == KERNEL.start + 0x10 and mapping == 1  # the leaf: its own pc
    assert lines == [("helper", "lib.c", 7), ("do_work", "work.c", 42)]
    # A caller's address is its return address minus one: inside the call instruction.
    assert got.locations[locations[1]][1:] == (
        KERNEL.start + 0x204,
        [("syscall_entry", "entry.S", 3)],
    )
    assert got.locations[locations[2]] == (0, 0x401233, [("main", "", 0)])
    assert labels == {
        "cpu": 0, "cpu_state": "oncpu", "pid": 3, "process": "shell (pid 3)", "mode": "kernel"
    }  # fmt: skip


def test_threads_are_labelled_with_tid_and_name() -> None:
    got = decode(render(threaded_profile(), "pprof"))
    labels = [s[2] for s in got.samples]
    assert {(ls["pid"], ls["tid"], ls["thread"]) for ls in labels} == {
        (40, 40, "app"),
        (40, 41, "app-worker"),
    }
    assert {ls["process"] for ls in labels} == {"app (pid 40)"}


def test_a_truncated_stack_ends_in_a_truncated_frame_and_is_labelled() -> None:
    got = decode(render(detailed_profile(), "pprof"))
    locations, _, labels = got.samples[2]
    assert labels == {
        "cpu": 0, "cpu_state": "oncpu", "process": "kernel", "mode": "kernel", "truncated": "true"
    }  # fmt: skip
    assert got.locations[locations[-1]] == (0, 0, [("[truncated]", "", 0)])
    assert got.locations[locations[0]][2][0][0] == "syscall_entry"


def folded_leaves(profile: Profile) -> Counter[str]:
    leaves: Counter[str] = Counter()
    for names, count in profile.named_counts(Naming()).items():
        leaves[names[-1].removesuffix(KERNEL_SUFFIX)] += count
    return leaves


def test_flat_counts_per_function_are_the_folded_leaves() -> None:
    profile = hand_built_profile()
    got = decode(render(profile, "pprof"))
    flat: Counter[str] = Counter()
    for i, (_, values, _) in enumerate(got.samples):
        flat[got.leaf_function(i)] += values[0]
        assert values[1] == values[0] * 10_000_000
    assert flat == folded_leaves(profile)
    assert {s[2]["cpu"] for s in got.samples} == {0, 1}


def test_symbol_less_frames_are_named_as_folded_names_them() -> None:
    unknown = Mapping("[unknown]", 0x400000, 0x500000, False)
    frames = (Frame(0x400010, False, module=unknown), Frame(0x7000, False))
    profile = Profile()
    profile.add(Sample(0, 0, Mode.USER, 3, 0, Stack(frames), Process(None, None, 0x1000)))
    names = [lines[0][0] for _, _, lines in decode(render(profile, "pprof")).locations.values()]
    assert names == ["0x400010", "[unknown]"]
    shown = decode(render(profile, "pprof", Naming(show_addresses=True))).locations.values()
    assert [lines[0][0] for _, _, lines in shown] == ["0x400010", "0x7000"]


def test_go_pprof_raw_shows_mappings_with_build_ids_and_kernel_addresses(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d.pb.gz"
    path.write_bytes(render(detailed_profile(), "pprof"))
    raw = go_pprof(tmp_path, "-raw", str(path))
    assert "1: 0xffffffff81000000/0xffffffff82000000/0x1000 /boot/vmlinux ab12" in raw
    assert "0xffffffff81000010 M=1 helper lib.c:7" in raw
    assert "truncated:[true]" in raw and "cpu:[0 vcpu]" in raw


def test_go_pprof_top_counts_are_the_folded_leaves(tmp_path: Path) -> None:
    profile = hand_built_profile()
    path = tmp_path / "h.pprof"
    path.write_bytes(render(profile, "pprof"))
    # -symbolize=none: pprof would otherwise shorten the C++-looking parse<T>.
    top = go_pprof(tmp_path, "-top", "-sample_index=samples", "-symbolize=none", str(path))
    assert top_flat(top) == folded_leaves(profile)
    traces = go_pprof(tmp_path, "-traces", str(path))
    assert "helper" not in traces and "(inline)" not in traces
    inlined = tmp_path / "d.pb.gz"
    inlined.write_bytes(render(detailed_profile(), "pprof"))
    assert "helper (inline)" in go_pprof(tmp_path, "-traces", str(inlined))


def test_a_stack_whose_user_space_is_gone_ends_in_its_frame_and_reads_back() -> None:
    """An exiting process's stack: whole (no truncated label) under a ``[user space gone]``
    root, in folded and pprof, and read back from pprof as such."""
    entry = Frame(KERNEL.start + 0x205, True, "syscall_entry", 0x5, KERNEL)
    exiting = Process(7, "head", 0xB000, 7, "head")
    profile = Profile(2.0, {"guest": "test"})
    stack = Stack((entry,), StopReason.USER_GONE)
    profile.add(Sample(0.002, 0, Mode.KERNEL, 0, 0xB000, stack, exiting))
    assert profile.truncated == 0
    assert (
        folded.render(profile, Naming()) == "head (pid 7);[user space gone];syscall_entry_[k] 1\n"
    )
    data = render(profile, "pprof")
    got = decode(data)
    locations, _, labels = got.samples[0]
    assert "truncated" not in labels
    assert got.locations[locations[-1]] == (0, 0, [("[user space gone]", "", 0)])
    again = pprofread.decode(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    assert again.named_counts(Naming()) == profile.named_counts(Naming())
    assert again.truncated == 0
