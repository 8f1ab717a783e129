"""The SVG flame graph's static content: geometry, colours, text, minimum width, escaping."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from fakes import named_sample, profile_of
from test_output import hand_built_profile

from qmpprof.naming import Naming
from qmpprof.output import svg
from qmpprof.profile import Profile

NS = {"s": "http://www.w3.org/2000/svg"}
FULL = svg.WIDTH - 2 * svg.PAD


def frames(text: str) -> dict[tuple[str, int], ET.Element]:
    """Frame groups by (tooltip, depth)."""
    root = ET.fromstring(text)
    found = {}
    for g in root.iterfind(".//s:g[@class='f']", NS):
        tip = g.findtext("s:title", namespaces=NS)
        assert tip is not None
        found[tip, int(g.attrib["data-d"])] = g
    return found


def rect(g: ET.Element) -> ET.Element:
    found = g.find("s:rect", NS)
    assert found is not None
    return found


def render(profile: Profile) -> str:
    return svg.render(profile, Naming())


def family(fill: str) -> str:
    """The palette a fill colour came from, told apart by its channels."""
    match = re.fullmatch(r"rgb\((\d+),(\d+),(\d+)\)", fill)
    assert match is not None
    r, g, b = map(int, match.groups())
    if b == 0 and r >= 190:
        return "kernel"
    if r >= 200 and g == b:
        return "user"
    if r <= 110 and g == b and g >= 165:
        return "root"
    raise AssertionError(fill)


def test_widths_are_shares_of_all_samples_and_the_root_is_at_the_bottom() -> None:
    found = frames(render(hand_built_profile()))
    base = rect(found["all (8 samples, 100.00%)", 0])
    main = rect(found["main (3 samples, 37.50%)", 3])
    assert float(base.attrib["width"]) == pytest.approx(FULL)
    assert float(main.attrib["width"]) == pytest.approx(FULL * 3 / 8)
    assert float(main.attrib["y"]) == float(base.attrib["y"]) - 3 * svg.FRAME_HEIGHT
    # compute (3) holds compute (2): the child starts where its parent does.
    outer = found["compute (3 samples, 37.50%)", 4]
    inner = found["compute (2 samples, 25.00%)", 5]
    assert outer.attrib["data-x"] == inner.attrib["data-x"] == "5"
    assert len(found) == 17


def test_colour_families_tell_kernel_user_and_contexts_apart() -> None:
    found = frames(render(hand_built_profile()))
    fills = {key: rect(g).attrib["fill"] for key, g in found.items()}
    assert family(fills["kmain_[k] (2 samples, 25.00%)", 2]) == "kernel"
    assert family(fills["sys_read_[k] (1 samples, 12.50%)", 5]) == "kernel"
    assert family(fills["page_fault_[k] (1 samples, 12.50%)", 3]) == "kernel"
    assert family(fills["read_line (1 samples, 12.50%)", 4]) == "user"
    assert family(fills["compute (3 samples, 37.50%)", 4]) == "user"
    assert family(fills["kernel (3 samples, 37.50%)", 1]) == "root"
    assert family(fills["worker (pid 4) (3 samples, 37.50%)", 1]) == "root"
    assert family(fills["[truncated] (1 samples, 12.50%)", 2]) == "root"
    # The same name gets the same colour wherever it is drawn.
    assert fills["_start (2 samples, 25.00%)", 2] == fills["_start (3 samples, 37.50%)", 2]


def test_colour_depends_on_the_name_only() -> None:
    assert svg.colour("schedule", "kernel") == svg.colour("schedule_[k]", "kernel")
    shades = {svg.colour(f"function_{i}", "user") for i in range(20)}
    assert len(shades) > 10
    assert {family(shade) for shade in shades} == {"user"}


def test_kernel_flag_without_suffix_comes_from_the_samples() -> None:
    profile = profile_of([])
    profile.add(named_sample(("kernel", "schedule"), kernel=(False, True)))
    found = frames(render(profile))
    assert family(rect(found["schedule_[k] (1 samples, 100.00%)", 2]).attrib["fill"]) == "kernel"


def test_title_and_subtitle_show_the_facts() -> None:
    root = ET.fromstring(render(hand_built_profile()))
    assert root.findtext(".//s:text[@id='title']", namespaces=NS) == (
        "qmpprof: fixtures/guest/emerald.elf"
    )
    subtitle = root.findtext(".//s:text[@id='subtitle']", namespaces=NS) or ""
    assert "duration: 0.04 s" in subtitle
    assert "rate: 100 Hz" in subtitle
    assert subtitle.index("samples: 8") < subtitle.index("rate")


def test_names_are_escaped_and_invalid_xml_characters_replaced() -> None:
    profile = profile_of([("kernel", "a<b>&\"c'", "bad\x01name")])
    found = frames(render(profile))  # parses: the escaping held
    assert ("a<b>&\"c' (1 samples, 100.00%)", 2) in found
    assert ("bad\ufffdname (1 samples, 100.00%)", 3) in found


def test_frames_below_the_minimum_width_are_left_out_but_counted() -> None:
    # One sample in 20000 is 0.06 px wide at 1180 px: below the 0.1 px default.
    stacks = [("kernel", "busy")] * 19999 + [("kernel", "rare")]
    text = render(profile_of(stacks))
    found = frames(text)
    assert ("kernel (20000 samples, 100.00%)", 1) in found
    assert not any(tip.startswith("rare") for tip, _ in found)
    assert ("rare (1 samples, 0.01%)", 2) in frames(svg.render(profile_of(stacks), Naming(), 0))


@pytest.mark.parametrize(
    ("name", "px", "label"),
    [
        ("schedule", 200.0, "schedule"),
        ("schedule", 3.5 + 5 * svg.CHAR_WIDTH, "sch.."),
        ("schedule", 3 + 2.9 * svg.CHAR_WIDTH, ""),
    ],
)
def test_labels_fit_their_frame(name: str, px: float, label: str) -> None:
    assert svg.label(name, px) == label


def test_an_empty_profile_is_still_a_valid_graph() -> None:
    root = ET.fromstring(render(Profile()))
    assert root.find(".//s:g[@class='f']", NS) is None
    assert any(t.text == "No samples" for t in root.iterfind(".//s:text", NS))


def test_the_file_is_self_contained() -> None:
    text = render(hand_built_profile())
    assert "<script><![CDATA[" in text
    assert not re.search(r"(src|href)=", text)
