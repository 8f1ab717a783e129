"""The figures of ``qmpprof top`` (output/topview.py) and the live view's keys (cli/top.py's
Live), on made profiles: window bounds, own and total counts, filters, the frozen view, and
Profile.forget_before keeping counts true."""

from __future__ import annotations

from fakes import named_sample, profile_of

from qmpprof.cli.top import Live
from qmpprof.model import Mode
from qmpprof.naming import Naming
from qmpprof.output import topview
from qmpprof.output.topview import Filter, Sort
from qmpprof.profile import Profile

A = ("app (pid 1)", "main", "work", "leaf")
B = ("app (pid 1)", "main", "work")
K = ("app (pid 1)", "main", "syscall_[k]", "copy_[k]")
D = ("db (pid 2)", "loop", "read_[k]")


def made(stacks: list[tuple[str, ...]], step: float = 1.0) -> Profile:
    profile = Profile()
    for i, names in enumerate(stacks):
        profile.add(named_sample(names, i * step, cpu=i % 2))
    return profile


def figures(window: topview.Window) -> dict[str, tuple[int, int]]:
    return {row.name: (row.own, row.total) for row in window.rows}


def test_own_and_total_count_each_function_once_per_sample() -> None:
    profile = profile_of([A, A, B, ("app (pid 1)", "rec", "rec", "rec")])
    shown = topview.window(profile, 60, Filter(), Sort.OWN, Naming())
    assert shown.samples == 4
    assert figures(shown) == {"leaf": (2, 2), "work": (1, 3), "main": (0, 3), "rec": (1, 1)}
    assert [row.name for row in shown.rows] == ["leaf", "work", "rec", "main"]  # ties: by total
    by_total = topview.window(profile, 60, Filter(), Sort.TOTAL, Naming())
    assert [row.name for row in by_total.rows] == ["work", "main", "leaf", "rec"]


def test_the_window_reaches_back_from_the_latest_sample() -> None:
    profile = made([A, A, A, B, B], step=1.0)  # at 0, 1, 2, 3, 4 s
    source = topview.latest(profile, 2.0)
    assert list(source.times) == [2.0, 3.0, 4.0]
    shown = topview.window(source, 2.0, Filter(), Sort.OWN, Naming())
    assert figures(shown)["leaf"] == (1, 1) and figures(shown)["work"] == (2, 3)
    assert shown.seconds == 2.0


def test_kernel_mode_keeps_kernel_frames_and_one_process_its_own() -> None:
    source = made([A, K, K, D])
    kernel = topview.window(source, 60, Filter(Mode.KERNEL), Sort.OWN, Naming())
    assert figures(kernel) == {"copy_[k]": (2, 2), "syscall_[k]": (0, 2), "read_[k]": (1, 1)}
    assert kernel.processes == (("app (pid 1)", 2), ("db (pid 2)", 1))
    one = topview.window(source, 60, Filter(Mode.KERNEL, "db (pid 2)"), Sort.OWN, Naming())
    assert figures(one) == {"read_[k]": (1, 1)} and one.samples == 1
    # The vCPUs line counts the window before any filter: (vCPU, kernel, user samples).
    assert one.cpus == kernel.cpus == ((0, 1, 1), (1, 2, 0))


def test_forget_before_drops_old_samples_and_their_counts() -> None:
    profile = made([A, A, B, B])
    profile.forget_before(2.0)
    assert list(profile.times) == [2.0, 3.0] and len(profile) == 2
    assert profile.named_counts(Naming()) == {B: 2}


class Run:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.stopped = False

    def request_stop(self) -> None:
        self.stopped = True


def live(profile: Profile) -> tuple[Live, Run]:
    view = Live.__new__(Live)
    view.__init__(opts=_Opts(), shown=Filter(), seconds=60)  # type: ignore[misc, arg-type]
    run = Run(profile)
    view.run = run  # type: ignore[assignment]
    return view, run


class _Opts:
    naming = Naming()
    guest = "vm"


def test_keys_sort_filter_cycle_processes_freeze_and_quit() -> None:
    profile = made([A, D, D])
    view, run = live(profile)
    view.refresh()
    assert view.shown is not None and view.shown.samples == 3
    view.key("n")
    assert view.filter.process == "db (pid 2)"  # the process with the most samples first
    view.key("n")
    assert view.filter.process == "app (pid 1)"
    view.key("n")
    assert view.filter.process is None  # past the last: all again
    view.key("k")
    view.key("p")
    profile.add(named_sample(D, 3.0))
    view.refresh()
    assert view.shown.samples == 2  # frozen: the new sample waits; the filter applies anew
    view.key("p")
    view.refresh()
    assert view.shown.samples == 3
    view.key("a")
    view.key("t")
    assert view.filter == Filter() and view.sort is Sort.TOTAL
    assert not run.stopped
    view.key("q")
    assert run.stopped
