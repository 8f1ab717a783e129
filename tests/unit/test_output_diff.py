"""Differential output (``qmpprof diff``): two-column folded stacks as difffolded.pl writes them,
and the differential SVG (AFTER's layout, colours by change in share, BEFORE-only stacks kept);
on a real run: tests/e2e/test_diff_guest_run.py."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from fakes import named_sample
from svgdiff import NS, blue, legend_of, red, tooltips

from qmpprof.cli import main
from qmpprof.naming import Naming
from qmpprof.output import diff, folded, render, svg
from qmpprof.profile import Profile
from qmpprof.stats import few_samples_margin

IDLE = ("kernel", "kmain", "idle_loop")
COMPUTE = ("spin (pid 1)", "_start", "main", "compute")
OLD = ("spin (pid 1)", "_start", "main", "old_path")
NEW = ("spin (pid 1)", "_start", "main", "new_path")


def profile_of(stacks: dict[tuple[str, ...], int]) -> Profile:
    profile = Profile(interval_ms=10.0, facts={"guest": "test"})
    for names, count in stacks.items():
        kernel = [names[0] == "kernel"] * len(names)
        for i in range(count):
            profile.add(named_sample(names, i / 100, 0, kernel))
    return profile


def before() -> Profile:
    return profile_of({IDLE: 4, COMPUTE: 4, OLD: 2})  # 10 samples


def after() -> Profile:
    return profile_of({IDLE: 2, COMPUTE: 8, NEW: 2})  # 12 samples


def test_folded_has_both_counts_for_the_union_of_stacks_sorted() -> None:
    text = diff.render_folded(before(), after(), Naming())
    assert text.splitlines() == [
        "kernel;kmain_[k];idle_loop_[k] 4 2",
        "spin (pid 1);_start;main;compute 4 8",
        "spin (pid 1);_start;main;new_path 0 2",
        "spin (pid 1);_start;main;old_path 2 0",
    ]
    # folded.parse reads the last column, as flamegraph.pl takes AFTER's counts for widths.
    assert sum(count for _, count in folded.parse(text)) == 12


def test_svg_is_laid_out_by_after_and_coloured_by_change_in_share() -> None:
    text = diff.render_svg(before(), after(), Naming(), ("a.qmpprof", "b.qmpprof"))
    tips = {}
    for g in ET.fromstring(text).iterfind(".//s:g[@class='f']", NS):
        tip = g.findtext("s:title", namespaces=NS) or ""
        rect = g.find("s:rect", NS)
        assert rect is not None
        tips[tip] = (rect.attrib["fill"], int(g.attrib["data-w"]), int(g.attrib["data-d"]))
    by_name: dict[tuple[str, int], tuple[str, int, str]] = {}
    for tip, (fill, width, depth) in tips.items():
        by_name[tip[: tip.rindex(" (")], depth] = (fill, width, tip)
    # Units: an AFTER sample is worth BEFORE's total (10), a BEFORE sample AFTER's (12).
    assert by_name["all", 0][1] == 12 * 10 + 2 * 12
    fill, width, tip = by_name["compute", 4]
    assert red(fill) and width == 8 * 10
    # 10 and 12 samples: shares known to ±31 and ±28 points, a change to ±42 (the tooltip says).
    assert tip == "compute (before 4, 40.00%; after 8, 66.67%; +26.67 points, within the noise)"
    fill, width, tip = by_name["idle_loop_[k]", 3]
    assert blue(fill) and width == 2 * 10 and "-23.33 points" in tip
    fill, width, tip = by_name["new_path", 4]
    assert red(fill) and width == 2 * 10 and tip.startswith("new_path (before 0, 0.00%; after 2,")
    # What AFTER lacks is drawn on a base of its own, at its BEFORE share, in blue.
    fill, width, tip = by_name["old_path", 5]
    assert blue(fill) and width == 2 * 12
    assert "after 0, 0.00%; -20.00 points, within the noise)" in tip
    fill, width, _ = by_name[diff.GONE, 1]
    assert blue(fill) and width == 2 * 12
    # main's before count holds every BEFORE sample under it, old_path's included.
    assert by_name["main", 3][2] == (
        "main (before 6, 60.00%; after 10, 83.33%; +23.33 points, within the noise)"
    )
    assert "a.qmpprof → b.qmpprof" in text and "totals normalised" in text
    assert by_name["all", 0][0] == diff.UNCHANGED


def fills_and_legend(old: Profile, new: Profile) -> tuple[dict[str, str], list[str]]:
    """Per frame name, its fill in the diff of ``old`` and ``new``; and the legend's texts."""
    text = diff.render_svg(old, new, Naming())
    return {name: fill for (name, _), (fill, _) in tooltips(text).items()}, legend_of(text)


def test_a_change_within_the_noise_is_never_full_colour() -> None:
    """250 samples a side: the run's summary warns that a share is known to ±6.2 points; a change
    of share to both margins combined, ±8.8. The largest change, 2.4 points, stays pale."""
    a, b = ("spin (pid 1)", "_start", "a"), ("spin (pid 1)", "_start", "b")
    fills, texts = fills_and_legend(profile_of({a: 125, b: 125}), profile_of({a: 131, b: 119}))
    margin = few_samples_margin(250)
    assert margin is not None and f"{margin:.0f}" == "6"  # what the summary says
    noise = (2 * margin**2) ** 0.5
    strength = 2.4 / noise
    assert fills["a"] == diff._fill(strength) != diff._fill(1.0)
    assert fills["b"] == diff._fill(-strength) != diff._fill(-1.0)
    assert red(fills["a"]) and blue(fills["b"])
    assert texts == [
        f"grew {noise:.1f} points or more",
        f"shrank {noise:.1f} points or more",
        f"this pale or paler: within the noise, ±{noise:.1f} points (95 %)",
        "unchanged",
    ]


def test_the_largest_change_past_the_noise_is_full_colour() -> None:
    """100 000 samples a side: the noise is ±0.4 points, so the 2.4-point change saturates."""
    a, b = ("spin (pid 1)", "_start", "a"), ("spin (pid 1)", "_start", "b")
    old, new = Profile(interval_ms=10.0), Profile(interval_ms=10.0)
    for profile, (count_a, count_b) in ((old, (50_000, 50_000)), (new, (52_400, 47_600))):
        for names, count in ((a, count_a), (b, count_b)):
            sid = profile.stack_id(named_sample(names))
            for _ in range(count):
                profile.add_at(0.0, 0, sid)
    fills, texts = fills_and_legend(old, new)
    assert fills["a"] == diff._fill(1.0) and fills["b"] == diff._fill(-1.0)
    assert texts[0] == "grew 2.4 points or more"
    assert texts[2] == "this pale or paler: within the noise, ±0.4 points (95 %)"


def test_the_same_shares_in_a_longer_run_are_unchanged() -> None:
    doubled = profile_of({IDLE: 8, COMPUTE: 8, OLD: 4})
    text = diff.render_svg(before(), doubled, Naming())
    fills = re.findall(r'<rect x="[^"]+" y="\d+" width="[^"]+" height="15" fill="([^"]+)"', text)
    assert fills and set(fills) == {diff.UNCHANGED}
    assert diff.GONE not in text


def test_the_svg_keeps_the_flame_graphs_controls() -> None:
    text = diff.render_svg(before(), after(), Naming())
    ET.fromstring(text)
    assert 'id="search"' in text and "Reset Zoom" in text and "<script>" in text
    assert text.count('class="f"') == len(re.findall(r"<title>", text))
    assert svg.render(before(), Naming()) == render(before(), "svg").decode()


def saved(tmp_path: Path, name: str, profile: Profile) -> Path:
    path = tmp_path / name
    path.write_bytes(render(profile, "qmpprof"))
    return path


def test_diff_command_writes_folded_and_svg(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = saved(tmp_path, "a.qmpprof", before()), saved(tmp_path, "b.qmpprof", after())
    out_folded, out_svg = tmp_path / "d.folded", tmp_path / "d.svg"
    assert main(["diff", str(a), str(b), "-o", str(out_folded), "-o", str(out_svg)]) == 0
    assert out_folded.read_text() == diff.render_folded(before(), after(), Naming())
    assert out_svg.read_text() == diff.render_svg(
        before(), after(), Naming(), ("a.qmpprof", "b.qmpprof")
    )
    assert capsys.readouterr().err.count("Wrote ") == 2
    assert main(["diff", str(a), str(b), "-u"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["2", "0", "-33.33", "pts", "old_path"]
    assert "idle_loop" not in out  # -u: user-mode samples only


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-o", "x.pb.gz"], "-o x.pb.gz: this command writes folded or svg, not pprof"),
        (["--format", "pprof"], "invalid choice: 'pprof'"),
    ],
)
def test_diff_command_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    a = saved(tmp_path, "a.qmpprof", before())
    assert main(["diff", str(a), str(a), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
