"""The explorer page in a real browser (headless Chromium from the system, driven by Playwright): type a prompt, wait
for the bars and heat maps, change the temperature and see the bars change, switch the mask after the softmax and
see the leak, read the logit lens, ablate a head, patch a corrupted prompt, see the enlarged map's labels and scale,
the stale mark, the model's own default prompt, take a screenshot. The page must ask for nothing outside 127.0.0.1
and log no console error."""

from __future__ import annotations

import pytest

from tests.explore.browser import chromium_path, launch, open_page
from tformer.explore.analysis import PYTHON_PROMPT

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


def lens_ready(page) -> str | None:
    return page.locator("#lens").get_attribute("data-ready")


def test_the_logit_lens_view(session):
    page = session.page
    before = lens_ready(page)
    session.analyze("the quick brown fox")
    session.until(lambda: lens_ready(page) != before, "the lens of the new prompt (drawn after the maps)")
    assert page.locator("#lens tr").count() == 4  # a header and three rows
    labels = page.locator("#lens tr th:first-child").all_inner_texts()
    assert labels == ["layer", "embed", "L0", "L1"]
    assert page.input_value("#lens-position") == "18"  # the last token by default
    assert page.locator("#lens tr:nth-child(2) td.lens-cell").count() == 5  # top 5
    assert "position #18" in page.inner_text("#lens-note")
    last = page.evaluate("() => state.last['/api/lens'].rows[2].top[0]")
    assert (
        page.locator("#lens tr:nth-child(4) td.lens-cell >> nth=0").inner_text().endswith(f"{100 * last['prob']:.1f}%")
    )
    before = lens_ready(page)
    page.click("#tokens .token >> nth=4")  # the lens at "q"
    session.until(lambda: lens_ready(page) != before, "the lens at position 4")
    assert 'position #4, token "q"' in page.inner_text("#lens-note") and page.input_value("#lens-position") == "4"


def test_clicking_a_head_ablates_it_and_the_bars_show_the_change(session):
    page = session.page
    session.analyze("the quick brown fox")
    page.check("input[name=click][value=ablate]")
    try:
        before = page.locator("#bars").get_attribute("data-ready")
        page.click("#grids canvas >> nth=6")  # layer 1, head 2
        session.until(lambda: page.locator("#bars").get_attribute("data-ready") != before, "the ablated bars")
        assert page.locator(".head.ablated .head-label").all_inner_texts() == ["L1 H2 off"]
        assert "ablated (zero): L1 H2" in page.inner_text("#ablation-note")
        assert page.locator("#bars .bar-original").count() == 20  # a tick at each token's own probability
        answer = page.evaluate("() => state.last['/api/ablate']")
        assert answer["heads"] == [[1, 2]]
        first = answer["next"][0]
        change = 100 * (first["prob"] - first["original"])
        assert session.bar_texts()[0] == f"{100 * first['prob']:.1f}% {'+' if change >= 0 else ''}{change:.1f}"
        before = page.locator("#bars").get_attribute("data-ready")
        page.click("#grids canvas >> nth=6")  # again: restored
        session.until(lambda: page.locator("#bars").get_attribute("data-ready") != before, "the model's own bars")
        assert page.locator(".head.ablated").count() == 0 and page.locator("#bars .bar-original").count() == 0
        assert page.is_hidden("#restore-heads")
    finally:
        page.check("input[name=click][value=enlarge]")


def test_the_patching_view(session):
    page = session.page
    page.fill("#patch-clean", "the cat sat")
    page.fill("#patch-corrupted", "the bat sat")
    page.click("#patch-run")
    session.until(lambda: page.locator("#patch-map").get_attribute("data-ready"), "the patching heat map")
    assert page.locator("#patch-map").get_attribute("data-shape") == "2x11"  # layers x positions
    note = page.inner_text("#patch-note")
    answer = page.evaluate("() => state.last['/api/patch']")
    assert f"clean {answer['clean_diff']:.3f}, corrupted {answer['corrupted_diff']:.3f}" in note
    assert answer["restored"][0][4] == pytest.approx(1.0, abs=1e-4) and "share of that gap restored" in note
    page.fill("#patch-corrupted", "a bat sat")
    page.click("#patch-run")
    session.until(lambda: page.inner_text("#patch-error"), "the error")
    assert "same token length" in page.inner_text("#patch-error")
    bad = [e for e in session.errors if "status of 400" in e]
    assert len(bad) == 1  # the browser logs the refused request; nothing else went wrong
    session.errors.remove(bad[0])


def test_the_enlarged_map_has_token_labels_and_a_colour_scale_and_heads_are_named(session):
    page = session.page
    session.analyze("the quick brown fox")
    page.click("#grids canvas >> nth=1")  # layer 0, head 1
    labels = page.evaluate("() => JSON.parse(document.getElementById('detail').dataset.labels)")
    tokens = page.locator("#tokens .token").all_inner_texts()
    assert labels == {"queries": [t.replace("\u00b7", " ") for t in tokens], "keys": labels["queries"]}
    weights = page.evaluate("() => state.maps['self/0'].weights[1]")
    assert page.locator("#detail").get_attribute("data-scale") == f"0 - {max(max(r) for r in weights):.3f}"
    inked = "(x, y, w, h) => { const d = document.getElementById('detail').getContext('2d').getImageData(x, y, w, h)"
    inked += ".data; let n = 0; for (let i = 0; i < d.length; i += 4) n += d[i] < 128; return n; }"
    assert page.evaluate(f"() => ({inked})(0, 0, 112, 520)") > 50  # query labels left of the map
    assert page.evaluate(f"() => ({inked})(112, 532, 520, 90)") > 50  # key labels below it
    assert page.evaluate(f"() => ({inked})(644, 8, 14, 520)") > 1000  # the colour bar, dark at its top
    names = page.locator(".grid .head-label").all_inner_texts()
    assert names == [f"L{layer} H{head}" for layer in range(2) for head in range(4)]
    caption = page.inner_text("#heads-caption")
    assert "entropy" in caption and "|Jacobian|" in caption and "saturated" in caption
    titles = [page.get_attribute(f"#heads th:nth-child({i})", "title") for i in (2, 3)]
    assert "nats" in titles[0] and "softmax's Jacobian" in titles[1]


def test_enter_analyzes_and_a_changed_prompt_is_marked_stale(session):
    page = session.page
    session.analyze("the quick brown fox")
    assert page.is_hidden("#stale") and "stale" not in page.get_attribute("#next-panel", "class")
    page.fill("#prompt", "a lazy dog")
    assert page.is_visible("#stale") and "previous prompt" in page.inner_text("#stale")
    assert all("stale" in page.get_attribute(f"#{p}", "class") for p in ("next-panel", "attention-panel", "lens-panel"))
    before = session.ready()
    page.press("#prompt", "Enter")
    session.wait_for_maps(before)
    assert page.input_value("#prompt") == "a lazy dog"  # Enter ran the analysis; it added no new line
    assert "".join(page.locator("#tokens .token").all_inner_texts()) == "a\u00b7lazy\u00b7dog"
    assert page.is_hidden("#stale") and "stale" not in page.get_attribute("#attention-panel", "class")


def test_a_model_trained_on_code_opens_on_code_and_shows_bytes_not_replacement_characters(browser, code_server):
    with open_page(browser, code_server.url) as s:
        assert s.page.input_value("#prompt") == PYTHON_PROMPT  # byte-level, trained on the Python standard library
        s.analyze("café")
        tokens = s.page.locator("#tokens .token").all_inner_texts()
        assert tokens == ["c", "a", "f", "<0xC3>", "<0xA9>"] and "\ufffd" not in s.page.inner_text("#bars")
        assert s.outside == [] and s.errors == []
