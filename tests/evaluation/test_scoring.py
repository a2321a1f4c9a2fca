"""The cached, batched scorer gives the log-likelihoods of one plain forward pass, and those of ``transformers``
reading the same GGUF file (float32), on a tiny Llama; the task scores are then the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.evaluation.conftest import QUESTIONS
from tformer.evaluation import protocols, scoring
from tformer.evaluation.model import from_pretrained
from tformer.evaluation.scoring import _buckets, _shared, score_requests, token_logprobs_reference

TOL = 1e-4  # float32: summed log-likelihoods of a few tokens (the errors seen are ~1e-6)


def requests_of(lm):
    pairs = [(c, " " + x) for c, choices, _ in QUESTIONS for x in choices]
    return [protocols.split_pair(lm.encode, c, x, lm.prefix) for c, x in pairs]


def hf_logprob(model, ctx, cont) -> tuple[float, bool]:
    """lm-eval's HFLM rule: one forward pass over ``(ctx + cont)[:-1]``, the continuation's log-softmax summed."""
    ids = torch.tensor([ctx + cont[:-1]])
    with torch.no_grad():
        logits = F.log_softmax(model(ids).logits[0, len(ctx) - 1 :].float(), dim=-1)
    target = torch.tensor(cont)
    return logits.gather(1, target[:, None]).sum().item(), bool((logits.argmax(-1) == target).all())


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_batched_cached_scores_equal_one_plain_pass_each(tiny, batch_size):
    lm = from_pretrained(tiny)
    reqs = requests_of(lm)
    scored = score_requests(lm.model, reqs, batch_size=batch_size, pad_id=lm.pad_id)
    for (ctx, cont), s in zip(reqs, scored):
        ref = token_logprobs_reference(lm.model, ctx, cont)
        assert s.logprob == pytest.approx(ref.sum().item(), abs=TOL)


def test_log_likelihoods_and_greedy_flags_equal_transformers(tiny, hf_tiny):
    lm = from_pretrained(tiny)
    model, tok = hf_tiny
    reqs = requests_of(lm)
    assert [lm.encode(c + x) for c, x in [("the cat", " sat")]] == [tok.encode("the cat sat")]
    scored = score_requests(lm.model, reqs, batch_size=4, pad_id=lm.pad_id)
    for (ctx, cont), s in zip(reqs, scored):
        lp, greedy = hf_logprob(model, ctx, cont)
        assert s.logprob == pytest.approx(lp, abs=TOL)
        assert s.greedy == greedy
    # the scores that follow from them are the same
    it = iter(scored)
    for c, choices, gold in QUESTIONS:
        ours = [next(it).logprob for _ in choices]
        theirs = [hf_logprob(model, *protocols.split_pair(lm.encode, c, " " + x, lm.prefix))[0] for x in choices]
        assert protocols.acc(ours, gold) == protocols.acc(theirs, gold)
        assert protocols.acc_norm(ours, choices, gold) == protocols.acc_norm(theirs, choices, gold)


def test_an_empty_continuation_is_refused_with_its_index(tiny):
    lm = from_pretrained(tiny)
    with pytest.raises(ValueError, match="request 1 has an empty continuation"):
        score_requests(lm.model, [([3], [4]), ([3], [])])


def test_buckets_cover_each_request_once_and_are_at_least_fill_full():
    lengths = [1, 30, 7, 8, 29, 2, 16, 15, 3, 22, 1, 9]
    runs = _buckets(lengths, fill=0.75)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    flat = [lengths[i] for run in runs for i in run]
    assert flat == sorted(lengths, reverse=True)  # longest first
    for run in runs:
        assert all(lengths[i] >= 0.75 * lengths[run[0]] for i in run)
    assert len(_buckets(lengths, fill=0.0)) == 1 and len(_buckets(lengths, fill=1.0)) == len(set(lengths))


def test_continuations_of_very_different_lengths_in_one_batch_score_exactly(tiny):
    lm = from_pretrained(tiny)
    text = "the cat sat on a mat and then the dog ran in the park when it rained on us"
    words = text.split(" ")
    reqs = [
        (lm.encode(" ".join(words[: 2 + q])), lm.encode(" " + " ".join(words[q : q + n])))
        for q in range(4)
        for n in (1, 2, 5, 11)
    ]
    assert_each_equals_its_plain_pass(lm, reqs, score_requests(lm.model, reqs, batch_size=4, pad_id=lm.pad_id))


def assert_each_equals_its_plain_pass(lm, reqs, scored) -> None:
    """Each request's log-likelihood (within ``TOL``) and greedy flag (exactly) are those of one plain forward
    pass over its own ``ctx + cont``."""
    for (ctx, cont), s in zip(reqs, scored, strict=True):
        ref = token_logprobs_reference(lm.model, ctx, cont)
        assert s.logprob == pytest.approx(ref.sum().item(), abs=TOL)
        with torch.no_grad():
            logits = lm.model(torch.tensor([ctx + cont[:-1]]))[0, len(ctx) - 1 :]
        assert s.greedy == bool((logits.argmax(-1) == torch.tensor(cont)).all())


def test_shared_leading_tokens_stop_at_the_first_difference_and_leave_each_a_token():
    assert _shared([[5, 6, 7, 8], [5, 6, 9]]) == 2
    assert _shared([[5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 1]]) == 2  # they differ before the last token
    assert _shared([[5, 6, 7], [5, 6, 7, 8]]) == 2  # a prefix of another keeps its last token
    assert _shared([[5, 6, 7]]) == 2  # one continuation: all but its last token go with the context
    assert _shared([[1, 2], [3, 2]]) == 0 and _shared([[4], [4, 5]]) == 0


def test_continuations_sharing_their_first_tokens_score_exactly(tiny):
    """Choices that begin alike (PIQA's solutions) have their common tokens run with the context once: each
    choice's log-likelihood and greedy flag still equal one plain pass over its own ``ctx + cont``."""
    lm = from_pretrained(tiny)
    stems = ["the cat sat on", "a dog ran", "we"]
    endings = [
        [" the mat and then slept", " the mat and then ran", " the mat and"],  # one a prefix of the others
        [" in the park", " in the rain"],
        [" sat on a mat", " sat on a mat"],  # the same text twice
    ]
    reqs = [(lm.encode(c), lm.encode(x)) for c, xs in zip(stems, endings, strict=True) for x in xs]
    reqs.append((lm.encode("then it"), lm.encode(" rained on us all day")))  # a context with one continuation
    for text in ("the park", "a park"):  # choices greedy after a shared first token that is greedy, or is not
        ctx = lm.encode(text)
        with torch.no_grad():
            last = lm.model(torch.tensor([ctx]))[0, -1]
            first = (last.argmax() if text == "the park" else last.argmin()).item()
            nxt = lm.model(torch.tensor([ctx + [first]]))[0, -1]
        reqs += [(ctx, [first, nxt.argmax().item()]), (ctx, [first, nxt.argmin().item()])]
    groups = [reqs[0:3], reqs[3:5], reqs[5:7]]
    shared = [_shared([x for _, x in g]) for g in groups]
    assert shared[0] == len(reqs[2][1]) - 1 and shared[1] > 0 and shared[2] == len(reqs[5][1]) - 1
    for batch_size in (1, 4):
        scored = score_requests(lm.model, reqs, batch_size=batch_size, pad_id=lm.pad_id)
        assert_each_equals_its_plain_pass(lm, reqs, scored)
        assert [s.greedy for s in scored[-4:]] == [True, False, False, False]  # the shared token counts


def test_the_output_head_in_pieces_gives_the_same_scores(tiny, monkeypatch):
    """Long windows (perplexity) score their positions in pieces of ``HEAD_ROWS`` so that the ``(rows, V)`` logits
    stay bounded; the pieces' seams change nothing."""
    lm = from_pretrained(tiny)
    reqs = requests_of(lm)
    whole = score_requests(lm.model, reqs, batch_size=64, pad_id=lm.pad_id)
    monkeypatch.setattr(scoring, "HEAD_ROWS", 3)
    pieces = score_requests(lm.model, reqs, batch_size=64, pad_id=lm.pad_id)
    assert [s.greedy for s in pieces] == [s.greedy for s in whole]
    assert [s.logprob for s in pieces] == pytest.approx([s.logprob for s in whole], abs=TOL)
    assert_each_equals_its_plain_pass(lm, reqs, pieces)
