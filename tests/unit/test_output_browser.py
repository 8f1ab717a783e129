"""The writers' output in a real headless Chromium: the SVG flame graph's interactions, and the
speedscope file checked against speedscope's own schema and opened in its own viewer.

Needs what scripts/setup-browser installs; without it these tests fail and say so.
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from browser import chromium, expect, serve, speedscope_release, speedscope_schema
from test_output import hand_built_profile

from qmpprof.naming import Naming
from qmpprof.output import speedscope, svg

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Locator, Page

pytestmark = pytest.mark.browser

MAGENTA = "rgb(230, 0, 230)"  # the search highlight
FULL_WIDTH = svg.WIDTH - 2 * svg.PAD


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as ctx:
        yield ctx


@pytest.fixture
def page(context: BrowserContext, tmp_path: Path) -> Iterator[Page]:
    """The hand-built profile's flame graph, opened from a file:// URL; fails on any JS error."""
    errors: list[str] = []
    path = tmp_path / "flame.svg"
    path.write_text(svg.render(hand_built_profile(), Naming()), encoding="utf-8")
    tab = context.new_page()
    tab.on("pageerror", lambda err: errors.append(str(err)))
    tab.goto(path.as_uri())
    yield tab
    tab.close()
    assert errors == []


def frame(page: Page, tooltip: str) -> Locator:
    return page.locator("g.f").filter(has=page.locator(f'title:text-is("{tooltip}")'))


def width(locator: Locator) -> float:
    return float(locator.locator("rect").get_attribute("width") or "nan")


def fill(locator: Locator) -> str:
    return str(locator.locator("rect").evaluate("r => getComputedStyle(r).fill"))


def test_hover_shows_the_tooltip_in_the_details_line(page: Page) -> None:
    main = frame(page, "main (3 samples, 37.50%)")
    details = page.locator("#details")
    assert details.text_content() == " "
    main.hover()
    expect(details).to_have_text("Function: main (3 samples, 37.50%)")
    page.mouse.move(5, 5)
    expect(details).not_to_contain_text("main")


def test_search_highlights_matches_and_reports_their_share(page: Page) -> None:
    page.once("dialog", lambda dialog: dialog.accept("^comp"))
    page.locator("#search").click()
    # compute inside compute is counted once: 3 of 8 samples.
    expect(page.locator("#matched")).to_have_text("Matched: 37.5%")
    assert fill(frame(page, "compute (2 samples, 25.00%)")) == MAGENTA
    assert fill(frame(page, "main (3 samples, 37.50%)")) != MAGENTA
    assert "s=%5Ecomp" in page.url


def test_ctrl_f_searches_and_the_case_toggle_widens_the_match(page: Page) -> None:
    page.once("dialog", lambda dialog: dialog.accept("MAIN|idle"))
    page.keyboard.press("Control+f")
    expect(page.locator("#matched")).to_have_text("Matched: 25.0%")
    page.locator("#case").click()
    expect(page.locator("#case")).to_have_text("Case: ignore")
    expect(page.locator("#matched")).to_have_text("Matched: 87.5%")
    assert fill(frame(page, "main (2 samples, 25.00%)")) == MAGENTA
    page.keyboard.press("Escape")
    expect(page.locator("g.f.match")).to_have_count(0)
    assert page.locator("#matched").text_content() == ""


def test_click_zooms_keeps_ancestors_and_reset_restores(page: Page) -> None:
    main = frame(page, "main (3 samples, 37.50%)")
    child = frame(page, "compute (3 samples, 37.50%)")
    other = frame(page, "kmain_[k] (2 samples, 25.00%)")
    assert width(main) == pytest.approx(FULL_WIDTH * 3 / 8)
    expect(page.locator("#reset")).to_be_hidden()
    main.click()
    expect(page.locator("#reset")).to_be_visible()
    assert width(main) == pytest.approx(FULL_WIDTH)
    assert width(child) == pytest.approx(FULL_WIDTH)
    assert other.is_hidden()
    assert frame(page, "worker (pid 4) (3 samples, 37.50%)").is_visible()
    assert "#x=5&d=3" in page.url
    page.locator("#reset").click()
    expect(page.locator("#reset")).to_be_hidden()
    assert width(main) == pytest.approx(FULL_WIDTH * 3 / 8)
    assert other.is_visible()
    assert "#" not in page.url


def test_the_url_fragment_restores_zoom_and_search(page: Page) -> None:
    page.goto(page.url + "#x=5&d=3&s=compute&i=1")
    page.reload()
    expect(page.locator("#matched")).to_have_text("Matched: 37.5%")
    assert width(frame(page, "main (3 samples, 37.50%)")) == pytest.approx(FULL_WIDTH)
    assert page.locator("#reset").is_visible()
    assert page.locator("#case").text_content() == "Case: ignore"


def schema_errors(document: object) -> list[str]:
    """What speedscope's published schema finds wrong with ``document``."""
    from jsonschema import Draft7Validator

    return [e.message for e in Draft7Validator(speedscope_schema()).iter_errors(document)]


@contextlib.contextmanager
def speedscope_tab(context: BrowserContext, tmp_path: Path, text: str) -> Iterator[Page]:
    """speedscope's own viewer opened on the file ``text``, served from ``tmp_path``; no page
    error by the time the tab closes."""
    (tmp_path / "viewer").symlink_to(speedscope_release())
    (tmp_path / "run.speedscope.json").write_text(text, encoding="utf-8")
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda err: errors.append(str(err)))
    with serve(tmp_path) as base:
        profile_url = urllib.parse.quote(f"{base}/run.speedscope.json", safe="")
        tab.goto(f"{base}/viewer/index.html#profileURL={profile_url}")
        tab.wait_for_function("document.title.endsWith(' - speedscope')")
        yield tab
    tab.close()
    assert errors == []


def test_speedscope_file_follows_the_published_schema() -> None:
    document = json.loads(speedscope.render(hand_built_profile(), Naming()))
    assert schema_errors(document) == []


def test_speedscope_viewer_opens_the_file(context: BrowserContext, tmp_path: Path) -> None:
    text = speedscope.render(hand_built_profile(), Naming())
    with speedscope_tab(context, tmp_path, text) as tab:
        assert tab.title() == "qmpprof: fixtures/guest/emerald.elf - speedscope"
        expect(tab.get_by_text("vcpu 0 (1/2)")).to_be_visible()
        # The sandwich view lists every frame of the profile as text (the others are canvases).
        tab.get_by_text("Sandwich").click()
        for name in ("kernel", "idle_loop_[k]", "shell (pid 3)", 'parse<T>&"x"', "sys_read_[k]"):
            expect(tab.get_by_text(name, exact=True)).to_be_visible()
        tab.keyboard.press("n")  # speedscope's key for the next profile
        expect(tab.get_by_text("vcpu 1 (2/2)")).to_be_visible()
        expect(tab.get_by_text("page_fault_[k]", exact=True)).to_be_visible()
        expect(tab.get_by_text("idle_loop_[k]", exact=True)).to_have_count(0)


def test_speedscope_opens_a_thread_lane_of_an_off_cpu_run(
    context: BrowserContext, tmp_path: Path
) -> None:
    from test_output_offcpu import mixed_profile

    text = speedscope.render(mixed_profile(), Naming())
    assert schema_errors(json.loads(text)) == []
    with speedscope_tab(context, tmp_path, text) as tab:
        tab.keyboard.press("n")  # from the vCPU's lane to the first thread's
        expect(tab.get_by_text("sleep (7/7) (2/3)")).to_be_visible()
        tab.get_by_text("Sandwich").click()
        for name in ("sleep (pid 7)", "[off-cpu: S]", "do_nanosleep_[k]"):
            expect(tab.get_by_text(name, exact=True)).to_be_visible()
        expect(tab.get_by_text("work (pid 9)", exact=True)).to_have_count(0)


def test_svg_switches_between_wall_on_cpu_and_off_cpu(
    context: BrowserContext, tmp_path: Path
) -> None:
    from test_output_offcpu import mixed_profile

    path = tmp_path / "wall.svg"
    path.write_text(svg.render(mixed_profile(), Naming()), encoding="utf-8")
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda err: errors.append(str(err)))
    tab.goto(path.as_uri())
    sleeper = frame(tab, "sleep (7/7) (2 samples, 50.00%)")
    assert sleeper.is_visible() and width(sleeper) == pytest.approx(FULL_WIDTH / 2)
    expect(tab.locator('text.view[data-view="wall"]')).to_have_class("button view active")
    tab.locator('text.view[data-view="cpu"]').click()
    assert sleeper.is_hidden() and "v=cpu" in tab.url
    worker = frame(tab, "work (9/9) (2 samples, 100.00%)")
    assert worker.is_visible() and width(worker) == pytest.approx(FULL_WIDTH)
    tab.once("dialog", lambda dialog: dialog.accept("^main$"))
    tab.locator("#search").click()
    expect(tab.locator("#matched")).to_have_text("Matched: 100.0%")  # of the view's samples
    tab.locator('text.view[data-view="off"]').click()
    expect(tab.locator("#matched")).to_have_text("Matched: 100.0%")
    assert worker.is_hidden()
    shown = tab.locator('g.view[data-view="off"]')
    assert fill(shown.locator("g.f.match")) == MAGENTA and shown.is_visible()
    tab.reload()  # the fragment keeps the view and the search
    expect(frame(tab, "[off-cpu: S] (2 samples, 100.00%)")).to_be_visible()
    tab.close()
    assert errors == []
