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
