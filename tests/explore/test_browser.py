"""The explorer page in a real browser (headless Chromium from the system, driven by Playwright): type a prompt, wait
for the bars and heat maps, change the temperature and see the bars change, switch the mask after the softmax and
see the leak, take a screenshot. The page must ask for nothing outside 127.0.0.1 and log no console error."""

from __future__ import annotations

import pytest

from tests.explore.browser import chromium_path, launch, open_page

pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra installs it)")
CHROMIUM = chromium_path()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium: `make browser` installs Debian's chromium"),
]


@pytest.fixture(scope="module")
def browser():
    with launch(CHROMIUM) as b:
        yield b


@pytest.fixture(scope="module")
def session(browser, lm_server):
    with open_page(browser, lm_server.url) as s:
        yield s


def test_the_page_analyzes_a_prompt(session):
    session.analyze("the quick brown fox")
    page = session.page
    tokens = page.locator("#tokens .token").all_inner_texts()
    assert "".join(tokens) == "the\u00b7quick\u00b7brown\u00b7fox"  # spaces made visible
    assert page.locator("#bars .bar").count() == 20
    assert page.locator("#grids canvas").count() == 2 * 4  # every layer and head
    assert "every row sums to 1" in page.inner_text("#leak")


def test_temperature_changes_the_bars(session):
    page = session.page
    before = session.bar_texts()
    page.fill("#temperature", "2.5")
    page.dispatch_event("#temperature", "change")
    session.until(lambda: session.bar_texts() != before, "the bars to change")
    after = session.bar_texts()
    assert after != before and float(after[0].rstrip("%")) < float(before[0].rstrip("%"))  # flatter at T = 2.5


def test_top_k_greys_out_the_rest(session):
    page = session.page
    page.fill("#top-k", "3")
    page.dispatch_event("#top-k", "change")
    session.until(lambda: page.locator("#bars .bar.dropped").count() == 17, "17 dropped tokens")
    page.fill("#top-k", "")
    page.dispatch_event("#top-k", "change")
    session.until(lambda: page.locator("#bars .bar.dropped").count() == 0, "no dropped token")


def test_a_late_answer_to_an_older_request_does_not_overwrite_the_bars(session):
    """The server computes one request at a time in no set order, so answers can come back out of order. Hold the
    answer for top-k = 5 back until the one for top-k = 3 is drawn, then let it through: the bars stay top-k = 3's."""
    page = session.page
    held = []

    def hold_the_first(route):
        if held:
            return route.fallback()
        held.append(route)

    def dropped_in_last_answer():  # the page's own record of the last answer it parsed (see api() in app.js)
        return page.evaluate("() => state.last['/api/analyze'].next.filter((n) => !n.kept).length")

    page.route("**/api/analyze", hold_the_first)
    try:
        page.fill("#top-k", "5")
        page.dispatch_event("#top-k", "change")
        session.until(lambda: held, "the request for top-k = 5")
        page.fill("#top-k", "3")
        page.dispatch_event("#top-k", "change")
        session.until(lambda: page.locator("#bars .bar.dropped").count() == 17, "17 dropped tokens")
        held[0].fallback()
        session.until(lambda: dropped_in_last_answer() == 15, "the late answer for top-k = 5")
        assert page.locator("#bars .bar.dropped").count() == 17
    finally:
        page.unroute("**/api/analyze", hold_the_first)
        page.fill("#top-k", "")
        page.dispatch_event("#top-k", "change")
        session.until(lambda: page.locator("#bars .bar.dropped").count() == 0, "no dropped token")


def test_masking_after_the_softmax_shows_the_leak(session):
    page = session.page
    before = page.locator("#grids").get_attribute("data-ready")
    page.check("input[name=mask][value=after]")
    session.wait_for_maps(before)
    assert "leaks the future" in page.inner_text("#leak")
    before = page.locator("#grids").get_attribute("data-ready")
    page.check("input[name=mask][value=before]")
    session.wait_for_maps(before)
    assert "every row sums to 1" in page.inner_text("#leak")


def test_late_answers_to_an_older_request_do_not_overwrite_the_maps(session):
    """As for the bars: hold back the two layers' maps with the mask after the softmax until the maps with it before
    are drawn, then let them through one at a time: the page keeps the newer maps (no leak)."""
    page = session.page
    held = []

    def hold_while_after(route):
        if route.request.post_data_json.get("mask") != "after":
            return route.fallback()
        held.append(route)

    def late_answer_parsed():  # the page's record of the last map answer it parsed: one with the leak
        return page.evaluate("() => (state.last['/api/attention'] || { row_sum_min: [1] }).row_sum_min[0] < 0.999")

    page.route("**/api/attention", hold_while_after)
    try:
        page.check("input[name=mask][value=after]")
        session.until(lambda: len(held) == 2, "the two layers' requests with the mask after the softmax")
        before = session.ready()
        page.check("input[name=mask][value=before]")
        session.wait_for_maps(before)
        for route in held:
            page.evaluate("() => { state.last['/api/attention'] = null; }")
            route.fallback()
            session.until(late_answer_parsed, "a late answer with the mask after the softmax")
        assert "every row sums to 1" in page.inner_text("#leak")
        assert page.locator("#grids canvas").count() == 2 * 4
    finally:
        page.unroute("**/api/attention", hold_while_after)


def test_clicking_a_map_enlarges_it_and_sampling_appends_a_token(session):
    page = session.page
    page.click("#grids canvas >> nth=6")  # layer 1, head 2
    assert "layer 1, head 2" in page.inner_text("#detail-title")
    prompt = page.input_value("#prompt")
    before = page.locator("#grids").get_attribute("data-ready")
    page.click("#sample")
    session.wait_for_maps(before)
    assert len(page.input_value("#prompt")) == len(prompt) + 1


def test_screenshot_and_nothing_outside_loopback(session, tmp_path):
    path = tmp_path / "explore.png"
    session.page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert session.outside == []
    assert session.errors == []


def test_an_encoder_decoder_shows_the_three_attention_types(browser, seq2seq_server):
    with open_page(browser, seq2seq_server.url) as s:
        s.page.fill("#target", "dlrow")
        s.analyze("hello world")
        titles = s.page.locator(".grid-title").all_inner_texts()
        assert titles == [
            "encoder self-attention",
            "decoder self-attention (causal)",
            "cross-attention (decoder -> encoder)",
        ]
        assert s.page.locator("#grids canvas").count() == 3 * 2 * 2  # three kinds x 2 layers x 2 heads
        before = s.ready()
        s.page.click("#sample")
        s.wait_for_maps(before)
        assert s.page.input_value("#target") != "dlrow"  # the drawn token joined the decoder prefix
        assert s.outside == [] and s.errors == []
