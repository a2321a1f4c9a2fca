"""Each rule of the two protocols on hand-made examples, against its written formula (tformer.evaluation.protocols
names the sources), and the figures' standard errors against their definitions."""

from __future__ import annotations

import math
import statistics

import pytest

from tformer.evaluation import metrics, protocols


def merging_encode(text: str) -> list[int]:
    """A toy tokenizer: ``" x"`` (a space and a letter) is one token (``1000 + letter``), every other character its
    own code point: so the encoding of ``context + continuation`` is not the concatenation of the two encodings."""
    ids, i = [], 0
    while i < len(text):
        if text[i] == " " and i + 1 < len(text) and text[i + 1].isalpha():
            ids.append(1000 + ord(text[i + 1]))
            i += 2
        else:
            ids.append(ord(text[i]))
            i += 1
    return ids


def test_the_continuation_is_the_whole_encoding_after_the_encoded_context():
    ctx, cont = protocols.split_pair(merging_encode, "Answer:", " yes", prefix=0)
    assert ctx == merging_encode("Answer:")
    assert cont == merging_encode("Answer: yes")[len(ctx) :] == [1000 + ord("y"), ord("e"), ord("s")]


def test_a_trailing_space_of_the_context_moves_into_the_continuation():
    # "Answer: " + "yes": the space joins the continuation (" y" one token), not the context
    ctx, cont = protocols.split_pair(merging_encode, "Answer: ", "yes", prefix=0)
    assert ctx == merging_encode("Answer:")
    assert cont == [1000 + ord("y"), ord("e"), ord("s")]
    # several whitespace characters move together
    ctx, cont = protocols.split_pair(merging_encode, "Q:\n ", "no", prefix=0)
    assert ctx == merging_encode("Q:") and cont == merging_encode("\n no")


def test_an_empty_context_is_the_prefix_token():
    assert protocols.split_pair(merging_encode, "", "ab", prefix=7) == ([7], [ord("a"), ord("b")])
    # a continuation that already starts with the prefix token conditions on it
    assert protocols.split_pair(lambda s: [7, 8, 9], "", "x", prefix=7) == ([7], [8, 9])


def test_truncation_drops_context_tokens_from_the_left():
    # lm-eval: (ctx + cont)[-(max_length + 1):][:-1] = [2, 3, 4, 5]: the model reads 4 tokens
    assert protocols.truncate([1, 2, 3, 4], [5, 6], max_length=4) == ([2, 3, 4], [5, 6])
    assert protocols.truncate([1, 2], [3], max_length=8) == ([1, 2], [3])


@pytest.mark.parametrize("n, max_length", [(1, 4), (4, 4), (5, 4), (10, 4), (13, 5), (3, 1)])
def test_rolling_windows_predict_every_token_once_with_at_most_max_length_inputs(n, max_length):
    tokens = list(range(100, 100 + n))
    windows = protocols.rolling_windows(tokens, prefix=0, max_length=max_length)
    predicted = [t for _, cont in windows for t in cont]
    assert predicted == tokens
    assert windows[0][0] == [0]  # the first window conditions on the prefix token
    for ctx, cont in windows:
        assert len(ctx) + len(cont) - 1 <= max_length  # what the model reads
        full = ctx + cont
        # the context is what comes right before the continuation in the text (the prefix for the first)
        assert full == ([0] + tokens)[tokens.index(cont[-1]) + 2 - len(full) : tokens.index(cont[-1]) + 2]


def test_rolling_windows_match_lm_evals_example():
    lm_eval = pytest.importorskip("lm_eval.utils", reason="lm-eval (the eval extra) is the reference here")
    ours = protocols.rolling_windows(list(range(23)), prefix=-1, max_length=5)
    windows = lm_eval.get_rolling_token_windows(list(range(23)), prefix_token=-1, max_seq_len=5, context_len=1)
    assert ours == [lm_eval.make_disjoint_window(w) for w in windows]
    # get_rolling_token_windows(list(range(10)), prefix=-1, max_seq_len=4, context_len=1), made disjoint
    windows = protocols.rolling_windows(list(range(10)), prefix=-1, max_length=4)
    assert windows == [([-1], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]), ([5, 6, 7], [8, 9])]  # the last reads 4 tokens


def test_acc_and_the_two_length_normalizations():
    lls = [-6.0, -4.0, -9.0]
    choices = [" abcdef", " ab", " abcdefghijk"]
    assert protocols.acc(lls, 1) == 1.0  # -4 is the largest sum
    # lm-eval divides by the characters of the choice as given: -6/7 = -0.857, -4/3 = -1.33, -9/12 = -0.75
    assert protocols.acc_norm(lls, choices, 2) == 1.0
    # lighteval's nospace does not count the leading space: -6/6 = -1, -4/2 = -2, -9/11 = -0.818
    assert protocols.acc_norm_nospace(lls, choices, 2) == 1.0
    # where they disagree: lm-eval -4.5/4 = -1.125 < -2/2 = -1.0 (choice 1); nospace -4.5/3 = -1.5 > -2/1 (choice 0)
    assert protocols.acc_norm([-4.5, -2.0], [" abc", " a"], 1) == 1.0
    assert protocols.acc_norm_nospace([-4.5, -2.0], [" abc", " a"], 0) == 1.0
    # a choice without a leading space counts every character
    assert protocols.acc_norm_nospace([-4.0, -2.5], ["abcd", " ab"], 0) == 1.0  # -1.0 vs -1.25


def test_ties_go_to_the_first_choice():
    assert protocols.argmax([-1.0, -1.0, -2.0]) == 0
    assert protocols.acc([-1.0, -1.0], 1) == 0.0


def test_word_and_byte_counts_are_lm_evals():
    assert protocols.words("a  b\nc") == 3
    assert protocols.words(" a") == 2  # re.split keeps the empty string before a leading space
    assert protocols.utf8_bytes("é!") == 3


def test_the_mean_and_its_standard_error():
    values = [1.0, 0.0, 1.0, 1.0, 0.0]
    fig = metrics.mean_figure(values)
    assert fig.value == pytest.approx(0.6, abs=1e-12)
    assert fig.stderr == pytest.approx(statistics.stdev(values) / math.sqrt(5), abs=1e-12)


def test_the_ratio_of_sums_and_its_delta_method_error():
    a, b = [-10.0, -30.0, -20.0], [5.0, 10.0, 5.0]
    fig = metrics.ratio_figure(a, b)
    assert fig.value == pytest.approx(-60 / 20, abs=1e-12)
    r = -3.0
    expected = math.sqrt(sum((x - r * y) ** 2 for x, y in zip(a, b)) / (3 * 2)) / (20 / 3)
    assert fig.stderr == pytest.approx(expected, abs=1e-12)
    ppl = metrics.exp_neg(fig)
    assert ppl.value == pytest.approx(math.exp(3.0), rel=1e-12)
    assert ppl.stderr == pytest.approx(math.exp(3.0) * expected, rel=1e-12)


def test_spearman_equals_scipys_with_ties():
    stats = pytest.importorskip("scipy.stats", reason="scipy is the reference of Spearman's rho here")
    x = [0.1, 0.4, 0.4, 0.9, 0.3, 0.7, 0.7, 0.2]
    y = [1.0, 2.0, 3.0, 5.0, 2.0, 4.0, 4.5, 0.0]
    fig = metrics.spearman_figure(x, y)
    assert fig.value == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    rho = fig.value
    assert fig.stderr == pytest.approx((1 - rho**2) * math.sqrt((1 + rho**2 / 2) / 5), abs=1e-12)
    assert metrics.ranks([3.0, 1.0, 3.0]) == [2.5, 1.0, 2.5]
