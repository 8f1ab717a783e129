"""Helpers for the browser tests: the system Chromium driven by Playwright, a quiet localhost
HTTP server, and the speedscope viewer and schema installed by scripts/setup-browser.

When something is missing the tests fail (never skip) with a message naming the setup script.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Locator
    from playwright.sync_api._generated import LocatorAssertions

CHROMIUM = Path("/usr/bin/chromium")
SPEEDSCOPE = Path(__file__).parent.parent / ".cache/node/node_modules/speedscope/dist/release"
SETUP_HINT = "run scripts/setup (it calls scripts/setup-browser) to install it"

# Without these Chromium reaches for update, sync and field-trial servers the CI cannot reach.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium(user_data_dir: Path) -> Iterator[BrowserContext]:
    """A headless Chromium context with an empty profile in ``user_data_dir``."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} not found: {SETUP_HINT}", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"the playwright package is missing: {SETUP_HINT}", pytrace=False)
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            user_data_dir,
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 800},
        )
        try:
            yield context
        finally:
            context.close()


def expect(locator: Locator) -> LocatorAssertions:
    """Playwright's auto-waiting assertions, imported late: only a test with a browser calls it."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not worth a line on the test's stderr."""


@contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve ``directory`` on a free localhost port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def speedscope_release() -> Path:
    """The directory of speedscope's built viewer (index.html) and its file-format schema."""
    if not (SPEEDSCOPE / "index.html").exists():
        pytest.fail(f"the speedscope npm package is missing in {SPEEDSCOPE}: {SETUP_HINT}")
    return SPEEDSCOPE


def speedscope_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(
        (speedscope_release() / "file-format-schema.json").read_text(encoding="utf-8")
    )
    return schema
