"""Driving the explorer page in a real browser: headless Chromium from the system (Debian's ``chromium`` package;
Playwright's own browser download is not reachable), through Playwright. Used by the browser test and, as a script,
to take the README's screenshot on the demo model::

    python -m tests.explore.browser runs/demo docs/explore.png

Every request the page makes is checked: anything not to the server's own 127.0.0.1 port is refused and recorded.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str | None:
    """The system's Chromium (``$TFORMER_CHROMIUM`` first), or ``None``."""
    if os.environ.get("TFORMER_CHROMIUM"):
        return os.environ["TFORMER_CHROMIUM"]
    return next((p for name in CANDIDATES if (p := shutil.which(name))), None)


@dataclass
class Session:
    page: object
    origin: str
    outside: list[str] = field(default_factory=list)  # requests the guard refused
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions

    def bar_texts(self) -> list[str]:
        return self.page.locator("#bars .bar-value").all_inner_texts()

    def until(self, condition, what: str, timeout: float = 30.0) -> None:
        """Poll ``condition()`` from Python (the page's policy forbids the string evaluation of
        ``wait_for_function``)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; errors: {self.errors}")
            self.page.wait_for_timeout(50)

    def ready(self) -> str | None:
        return self.page.locator("#grids").get_attribute("data-ready")

    def wait_for_maps(self, before: str | None) -> None:
        self.until(lambda: self.ready() not in (None, before), "the heat maps")

    def analyze(self, prompt: str) -> None:
        before = self.ready()
        self.page.fill("#prompt", prompt)
        self.page.click("#analyze")
        self.wait_for_maps(before)


@contextmanager
def launch(executable: str):
    """A headless Chromium (the system's binary) under Playwright."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def open_page(browser, url: str):
    """A page of ``browser`` at ``url`` with the request guard and the console collected, once its maps are drawn."""
    origin = url.rstrip("/")
    page = browser.new_page(viewport={"width": 1280, "height": 1600})
    session = Session(page, origin)

    def guard(route):
        if route.request.url.startswith(origin + "/"):
            return route.continue_()
        session.outside.append(route.request.url)
        return route.abort()

    page.route("**/*", guard)
    page.on("console", lambda m: m.type == "error" and session.errors.append(m.text))
    page.on("pageerror", lambda e: session.errors.append(str(e)))
    try:
        page.goto(url)
        session.wait_for_maps(None)
        yield session
    finally:
        page.close()


@contextmanager
def browser_session(url: str, executable: str):
    with launch(executable) as browser, open_page(browser, url) as session:
        yield session


@contextmanager
def serving(checkpoint: str | Path):
    from tformer.explore.analysis import open_model
    from tformer.explore.server import ExploreServer

    server = ExploreServer(open_model(checkpoint), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def screenshot(
    checkpoint: str,
    out: str,
    prompt: str = "def fibonacci(n):\n    return",
    corrupted: str = "def fibonacci(n):\n    yield ",
) -> None:
    """The page on ``prompt`` with one map enlarged, one head ablated and ``corrupted`` patched into ``prompt``."""
    executable = chromium_path()
    if executable is None:
        raise SystemExit("no Chromium found: install Debian's chromium package (make browser) or set TFORMER_CHROMIUM")
    with serving(checkpoint) as server, browser_session(server.url, executable) as session:
        session.analyze(prompt)
        page = session.page
        page.click("#grids canvas >> nth=5")
        before = page.locator("#bars").get_attribute("data-ready")
        page.click("#grids canvas >> nth=9", modifiers=["Shift"])  # ablates layer 2, head 1
        session.until(lambda: page.locator("#bars").get_attribute("data-ready") != before, "the ablated bars")
        page.fill("#patch-corrupted", corrupted)
        page.click("#patch-run")
        session.until(lambda: page.locator("#patch-map").get_attribute("data-ready"), "the patching map", 300)
        session.page.screenshot(path=out, full_page=True)
        if session.outside or session.errors:
            raise SystemExit(f"the page asked for {session.outside} or logged {session.errors}")


if __name__ == "__main__":
    screenshot(*sys.argv[1:3])
