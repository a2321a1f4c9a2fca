"""The cached, batched scorer gives the log-likelihoods of one plain forward pass, and those of ``transformers``
reading the same GGUF file (float32), on a tiny Llama; the task scores are then the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.evaluation.conftest import QUESTIONS
from tformer.evaluation import protocols
from tformer.evaluation.model import from_pretrained
from tformer.evaluation.scoring import _buckets, score_requests, token_logprobs_reference

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
    scored = score_requests(lm.model, reqs, batch_size=4, pad_id=lm.pad_id)
    for (ctx, cont), s in zip(reqs, scored, strict=True):
        ref = token_logprobs_reference(lm.model, ctx, cont)
        assert s.logprob == pytest.approx(ref.sum().item(), abs=TOL)
        with torch.no_grad():
            logits = lm.model(torch.tensor([ctx + cont[:-1]]))[0, len(ctx) - 1 :]
        assert s.greedy == bool((logits.argmax(-1) == torch.tensor(cont)).all())
