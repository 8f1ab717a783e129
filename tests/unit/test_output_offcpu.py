"""Off-CPU samples in every output: folded and SVG put ``[off-cpu: S]`` right above the process
root, pprof labels them ``cpu_state``/``state``, a ``.qmpprof`` and a pprof read back keep
them, and ``report --on-cpu``/``--off-cpu`` draws either alone."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from xml.etree import ElementTree

import pytest
from gopprof import decode
from test_output_native import KERNEL

from qmpprof.cli import report
from qmpprof.model import NO_CPU, Frame, Mode, Process, Sample, Stack
from qmpprof.naming import Naming
from qmpprof.output import native, render, svg
from qmpprof.output.pprofread import decode as read_pprof
from qmpprof.profile import Profile

SLEEPER = Process(7, "sleep", 0xB000, 7, "sleep")
WORKER = Process(9, "work", 0xC000, 9, "work")
SCHEDULE = Frame(KERNEL.start + 0x300, True, "schedule", 0, KERNEL)
NANOSLEEP = Frame(KERNEL.start + 0x400, True, "do_nanosleep", 0, KERNEL)
MAIN = Frame(0x401000, False, "main", 0)
ON_CPU = ("work (pid 9)", "main")
SVG = "{http://www.w3.org/2000/svg}"
OFF_CPU = ("sleep (pid 7)", "[off-cpu: S]", "main", "do_nanosleep_[k]", "schedule_[k]")


def mixed_profile() -> Profile:
    """Two ticks: the worker on vCPU 0 at each, the sleeper off CPU at each."""
    profile = Profile(10.0, {"guest": "test"})
    for tick in (0.01, 0.02):
        profile.add(Sample(tick, 0, Mode.USER, True, 0, Stack((MAIN,)), WORKER))
        stack = Stack((SCHEDULE, NANOSLEEP, MAIN))
        profile.add(Sample(tick, NO_CPU, Mode.KERNEL, False, 0, stack, SLEEPER, "S"))
    return profile


def test_folded_and_svg_show_the_state_above_the_process() -> None:
    profile = mixed_profile()
    assert profile.named_counts(Naming()) == {ON_CPU: 2, OFF_CPU: 2}
    assert profile.cpus == [0]
    assert b"[off-cpu: S]" in render(profile, "svg", Naming())
    lines = render(profile, "folded", Naming()).decode().splitlines()
    assert f"{';'.join(OFF_CPU)} 2" in lines


def test_pprof_labels_say_on_or_off_cpu_and_the_state() -> None:
    data = render(mixed_profile(), "pprof", Naming())
    labels = sorted((s[2] for s in decode(data).samples), key=lambda ls: ls["process"])
    assert labels[0]["cpu_state"] == "offcpu" and labels[0]["state"] == "S"
    assert "cpu" not in labels[0]  # off CPU: no vCPU
    assert labels[1]["cpu_state"] == "oncpu" and "state" not in labels[1]
    again = read_pprof(gzip.decompress(data))
    assert again.named_counts(Naming()) == {ON_CPU: 2, OFF_CPU: 2}


def test_a_saved_profile_keeps_the_states(tmp_path: Path) -> None:
    path = tmp_path / "run.qmpprof"
    path.write_bytes(render(mixed_profile(), "qmpprof"))
    again = native.load(path)
    assert again.named_counts(Naming()) == {ON_CPU: 2, OFF_CPU: 2}
    assert list(again.cpus_of) == [0, NO_CPU, 0, NO_CPU]


@pytest.mark.parametrize(("flag", "kept"), [("--on-cpu", ON_CPU), ("--off-cpu", OFF_CPU)])
def test_report_draws_on_or_off_cpu_alone(tmp_path: Path, flag: str, kept: tuple[str]) -> None:
    saved, out = tmp_path / "run.qmpprof", tmp_path / "out.folded"
    saved.write_bytes(render(mixed_profile(), "qmpprof"))
    assert report.main([str(saved), flag, "-o", str(out)]) == 0
    assert out.read_text() == f"{';'.join(kept)} 2\n"


def test_speedscope_gives_each_thread_a_lane_of_the_whole_run() -> None:
    document = json.loads(render(mixed_profile(), "speedscope", Naming()))
    lanes = {lane["name"]: lane for lane in document["profiles"]}
    assert list(lanes) == ["vcpu 0", "sleep (7/7)", "work (9/9)"]
    names = [frame["name"] for frame in document["shared"]["frames"]]
    on_cpu, off_cpu = ([tuple(names[i] for i in s) for s in lanes[t]["samples"]] for t in
                       ("work (9/9)", "sleep (7/7)"))  # fmt: skip
    assert on_cpu == [ON_CPU, ON_CPU] and off_cpu == [OFF_CPU, OFF_CPU]
    # Its two ticks, an interval of guest run time each, end to end (the axis is the weights').
    assert lanes["sleep (7/7)"]["endValue"] == sum(lanes["sleep (7/7)"]["weights"]) == 20.0


def test_speedscope_draws_threads_only_when_tasks_off_cpu_are_in() -> None:
    on_cpu = mixed_profile().select(on_cpu=True)
    document = json.loads(render(on_cpu, "speedscope", Naming()))
    assert [lane["name"] for lane in document["profiles"]] == ["vcpu 0"]


def test_svg_draws_wall_on_cpu_and_off_cpu_views_with_a_frame_per_thread() -> None:
    drawn = ElementTree.fromstring(render(mixed_profile(), "svg", Naming()))
    views = {g.get("data-view"): g for g in drawn.iter(f"{SVG}g") if g.get("data-view")}
    assert {v: g.get("data-total") for v, g in views.items()} == {
        "wall": "4",
        "cpu": "2",
        "off": "2",
    }
    assert [v for v, g in views.items() if "hidden" in (g.get("class") or "")] == ["cpu", "off"]

    def tips(view: str) -> set[str]:
        return {str(t.text) for t in views[view].iter(f"{SVG}title")}

    assert {"sleep (7/7) (2 samples, 50.00%)", "[off-cpu: S] (2 samples, 50.00%)"} <= tips("wall")
    assert "work (9/9) (2 samples, 50.00%)" in tips("wall")
    assert "work (9/9) (2 samples, 100.00%)" in tips("cpu")
    assert not any("sleep" in tip or "off-cpu" in tip for tip in tips("cpu"))
    assert not any("work" in tip for tip in tips("off"))
    fills = {str(g.findtext(f"{SVG}title")).split(" (2 ")[0]: g.find(f"{SVG}rect") for g in
             views["off"].iter(f"{SVG}g")}  # fmt: skip
    for name in ("sleep (7/7)", "[off-cpu: S]"):  # the writer's frames: the context's colours
        assert fills[name] is not None and fills[name].get("fill") == svg.colour(name, "root")


def test_svg_without_tasks_off_cpu_is_one_graph_without_a_switch() -> None:
    text = render(mixed_profile().select(on_cpu=True), "svg", Naming()).decode()
    assert 'class="view' not in text and "(9/9)" not in text
