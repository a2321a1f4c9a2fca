"""Seq2seq decoding (:mod:`tformer.generation.seq2seq`): greedy and beam search against uncached and exhaustive
search."""

import itertools
from types import SimpleNamespace

import pytest
import torch

from tformer.generation.seq2seq import beam_search, gnmt_length_penalty, greedy_seq2seq


# --------------------------------------------------------------------------------------------------
# Greedy and beam search
# --------------------------------------------------------------------------------------------------
def _next_logits(model, tokens, memory, mask, bos):
    """The decoder's logits for the token after BOS + ``tokens``, with BOS itself never a candidate."""
    logits = model.decode(torch.tensor([[bos] + tokens]), memory, mask)[0, -1]
    return logits.index_fill(0, torch.tensor([bos]), float("-inf"))


def _uncached_greedy(model, src, mask, bos, eos, steps):
    """The oracle: re-run the whole decoder on BOS + the tokens so far, one source at a time."""
    outputs = []
    for i in range(src.shape[0]):
        n = int(mask[i].sum())
        memory = model.encode(src[i : i + 1, :n])
        out = []
        while len(out) < steps:
            token = int(_next_logits(model, out, memory, None, bos).argmax())
            if token == eos:
                break
            out.append(token)
        outputs.append(out)
    return outputs


def test_greedy_seq2seq_equals_uncached_one_by_one_greedy(random_seq2seq, random_sources):
    lengths = []
    for seed in (1, 8):
        model = random_seq2seq(vocab=6, seed=seed)
        src, mask = random_sources([5, 2, 7, 4], vocab=6, low=3, seed=seed)
        with torch.no_grad():
            expected = _uncached_greedy(model, src, mask, bos=1, eos=2, steps=10)
        assert greedy_seq2seq(model, src, mask, bos_id=1, eos_id=2, max_new_tokens=10) == expected
        lengths += [len(e) for e in expected]
    assert min(lengths) < 10 == max(lengths)  # outputs ended by EOS and by max_new_tokens both occur


@pytest.mark.parametrize("position", ["sinusoidal", "rotary", "learned"])
def test_beam_size_one_is_greedy(random_seq2seq, random_sources, position):
    model = random_seq2seq(seed=2, position=position)
    src, mask = random_sources([6, 3, 8, 1], vocab=32, seed=2)
    greedy = greedy_seq2seq(model, src, mask, bos_id=1, eos_id=2, max_new_tokens=12)
    beam = beam_search(model, src, mask, beam_size=1, length_penalty=0.0, bos_id=1, eos_id=2, max_new_tokens=12)
    assert beam == greedy


def _exhaustive_best(model, src, mask, *, bos, eos, vocab, max_len, alpha):
    """Score every possible output (EOS-terminated of length <= max_len, or max_len tokens without EOS)."""
    symbols = [t for t in range(vocab) if t not in (eos, bos)]
    best = []
    for i in range(src.shape[0]):
        memory = model.encode(src[i : i + 1], mask[i : i + 1])
        candidates = [list(p) + [eos] for n in range(max_len) for p in itertools.product(symbols, repeat=n)]
        candidates += [list(p) for p in itertools.product(symbols, repeat=max_len)]
        scored = []
        for length in range(1, max_len + 1):
            group = [c for c in candidates if len(c) == length]
            tgt = torch.tensor([[bos] + c[:-1] for c in group])  # teacher forcing
            logp = model.decode(tgt, memory.expand(len(group), -1, -1), mask[i : i + 1].expand(len(group), -1))
            logp = logp.index_fill(-1, torch.tensor([bos]), float("-inf")).double().log_softmax(-1)  # BOS: never
            logp = logp.gather(-1, torch.tensor(group)[..., None])[..., 0].sum(-1)
            lp = gnmt_length_penalty(length, alpha)
            scored += [(float(s) / lp, c) for s, c in zip(logp, group)]
        _, winner = max(scored, key=lambda item: item[0])
        best.append(winner[:-1] if winner[-1] == eos else winner)
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_large_beam_finds_the_exhaustive_optimum(random_seq2seq, random_sources, alpha):
    vocab, max_len, bos, eos = 4, 4, 0, 1
    # with K >= (live prefixes) x V = 3^3 x 4 candidates at the last step, nothing is ever pruned
    beam_size = (vocab - 1) ** (max_len - 1) * vocab
    non_greedy = non_empty = 0
    for seed, head_scale in itertools.product(range(3), (1.0, 2.0)):  # scale 2: peakier, EOS less likely
        model = random_seq2seq(vocab=vocab, seed=10 + seed, eos=eos)
        with torch.no_grad():
            model.head.weight.mul_(head_scale)
        src, mask = random_sources([5, 3], vocab=vocab, low=0, seed=seed)
        with torch.no_grad():
            expected = _exhaustive_best(model, src, mask, bos=bos, eos=eos, vocab=vocab, max_len=max_len, alpha=alpha)
        got = beam_search(
            model, src, mask, beam_size=beam_size, length_penalty=alpha, bos_id=bos, eos_id=eos, max_new_tokens=max_len
        )
        assert got == expected
        greedy = greedy_seq2seq(model, src, mask, bos_id=bos, eos_id=eos, max_new_tokens=max_len)
        non_greedy += sum(g != e for g, e in zip(greedy, expected))
        non_empty += sum(len(e) > 0 for e in expected)
    assert non_greedy > 0 and non_empty > 0  # the search had something to find beyond greedy and beyond ""


def _naive_beam(model, src, mask, *, beam_size, alpha, max_len, bos, eos):
    """Beam search written plainly, one source at a time, re-running the decoder on whole prefixes, and
    never stopping early: the same rules (EOS among the K best candidates completes; the K best non-EOS
    candidates live on; at max_len the live beams complete), the best complete hypothesis wins."""
    results = []
    for i in range(src.shape[0]):
        memory = model.encode(src[i : i + 1], mask[i : i + 1])
        beams, complete = [([], 0.0)], []
        for step in range(1, max_len + 1):
            candidates = []
            for tokens, score in beams:
                logp = _next_logits(model, tokens, memory, mask[i : i + 1], bos).double().log_softmax(-1)
                candidates += [(score + float(logp[v]), tokens, v) for v in range(logp.shape[0]) if v != bos]
            candidates.sort(key=lambda c: -c[0])
            lp = gnmt_length_penalty(step, alpha)
            complete += [(s / lp, tokens) for s, tokens, v in candidates[:beam_size] if v == eos]
            beams = [(tokens + [v], s) for s, tokens, v in candidates if v != eos][:beam_size]
        complete += [(s / gnmt_length_penalty(max_len, alpha), tokens) for tokens, s in beams]
        results.append(max(complete, key=lambda c: c[0])[1])
    return results


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_beam_search_equals_a_plain_uncached_beam_search_without_early_stopping(random_seq2seq, random_sources, alpha):
    # a small vocabulary and long outputs: K hypotheses complete long before max_new_tokens, so early stopping
    # is exercised (with alpha = 2 stopping as soon as K are complete gives different, worse outputs)
    model = random_seq2seq(vocab=5, seed=10)
    src, mask = random_sources([5, 3, 6, 2, 4], vocab=5, low=3, seed=10)
    with torch.no_grad():
        expected = _naive_beam(model, src, mask, alpha=alpha, max_len=16, bos=1, eos=2, beam_size=3)
    got = beam_search(model, src, mask, beam_size=3, length_penalty=alpha, max_new_tokens=16, bos_id=1, eos_id=2)
    assert got == expected


def test_beam_search_prefers_longer_outputs_as_alpha_grows(random_seq2seq, random_sources):
    model = random_seq2seq(vocab=8, seed=5)
    src, mask = random_sources([6, 4, 5, 7, 3, 6], vocab=8, low=3, seed=5)
    kwargs = dict(beam_size=6, bos_id=1, eos_id=2, max_new_tokens=10)
    short = beam_search(model, src, mask, length_penalty=0.0, **kwargs)
    long = beam_search(model, src, mask, length_penalty=3.0, **kwargs)
    assert sum(map(len, long)) > sum(map(len, short))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(beam_size=0), "beam_size"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(eos_id=32), "eos_id"),
        (dict(bos_id=-1), "bos_id"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(length_penalty=float("inf")), "length_penalty"),
        (dict(length_penalty=-0.5), "length_penalty"),
        (dict(beam_size=1.5), "beam_size"),
    ],
)
def test_beam_search_rejects_bad_arguments(random_seq2seq, random_sources, kwargs, message):
    model = random_seq2seq()
    src, mask = random_sources([3], vocab=32)
    args = dict(beam_size=2, bos_id=1, eos_id=2, max_new_tokens=5) | kwargs
    with pytest.raises(ValueError, match=message):
        beam_search(model, src, mask, **args)


def test_learned_positions_bound_the_output_length(random_seq2seq, random_sources):
    model = random_seq2seq(position="learned", max_seq_len=8)
    src, mask = random_sources([3], vocab=32)
    assert len(beam_search(model, src, mask, beam_size=2, bos_id=1, eos_id=2, max_new_tokens=8)) == 1
    with pytest.raises(ValueError, match="max_seq_len=8"):
        beam_search(model, src, mask, beam_size=2, bos_id=1, eos_id=2, max_new_tokens=9)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        greedy_seq2seq(model, src, mask, bos_id=1, eos_id=2, max_new_tokens=9)


def test_nan_model_raises_a_clear_error_in_greedy_and_beam_search(random_seq2seq, random_sources):
    model = random_seq2seq()
    with torch.no_grad():
        model.decoder.stack.blocks[0].ff.up.weight[0, 0] = float("nan")  # a diverged checkpoint
    src, mask = random_sources([3, 5], vocab=32)
    with pytest.raises(ValueError, match="NaN .*logits.*diverged"):
        greedy_seq2seq(model, src, mask, bos_id=1, eos_id=2, max_new_tokens=5)
    for beam_size in (1, 3):
        with pytest.raises(ValueError, match="NaN .*logits.*diverged"):
            beam_search(model, src, mask, beam_size=beam_size, bos_id=1, eos_id=2, max_new_tokens=5)


def test_beam_search_without_a_finite_complete_hypothesis_returns_the_best_live_beam(random_seq2seq, random_sources):
    """NaN only from the second step on (the decoder's position 1), and EOS the least likely first token: no
    hypothesis ever completes with a finite score, so each source falls back to a live beam (every score is
    NaN by then, so which one is arbitrary) instead of failing with an IndexError."""
    model = random_seq2seq(position="learned", max_seq_len=8)
    src, mask = random_sources([3, 5], vocab=32)
    with torch.no_grad():
        first = model.decode(torch.ones(2, 1, dtype=torch.long), model.encode(src, mask), mask)[:, -1]  # (B, V)
        model.decoder.embed.positions.table.weight[1] = float("nan")
    eos = int(first.sum(dim=0).argmin())  # far from the top 2 of either source
    assert all(eos not in row.topk(4).indices for row in first)
    out = beam_search(model, src, mask, beam_size=2, length_penalty=0.0, bos_id=1, eos_id=eos, max_new_tokens=2)
    assert len(out) == 2 and all(len(row) == 2 and min(row) >= 0 and max(row) < 32 for row in out)


def test_bad_source_ids_are_named_before_decoding(random_seq2seq, random_sources):
    """The decoders check their input once (the model's forward reads no ids back): a clear error, not garbage."""
    model = random_seq2seq()
    src, mask = random_sources([3, 5], vocab=32)
    src[1, 2] = 32
    for decode in (greedy_seq2seq, lambda *a, **k: beam_search(*a, beam_size=2, **k)):
        with pytest.raises(ValueError, match=r"src holds token id 32, outside the vocabulary \[0, 32\)"):
            decode(model, src, mask, bos_id=1, eos_id=2, max_new_tokens=4)


def test_the_start_token_is_never_output_even_when_the_model_prefers_it(random_seq2seq, random_sources):
    """An under-trained model may rank BOS first (it decodes to nothing, so outputs came out short); both searches
    skip it and take the next best token, as the oracle with BOS's logit at -inf does."""
    model = random_seq2seq(vocab=8, seed=3, logits_bias=True)
    model.logits_bias[1] = 100.0  # BOS = 1: the top logit at every step
    src, mask = random_sources([5, 3, 6], vocab=8, low=3, seed=3)
    with torch.no_grad():
        plain = model.decode(torch.ones(3, 1, dtype=torch.long), model.encode(src, mask), mask)[:, -1]
        expected = _uncached_greedy(model, src, mask, bos=1, eos=2, steps=6)
    assert (plain.argmax(-1) == 1).all()  # the unconstrained choice
    greedy = greedy_seq2seq(model, src, mask, bos_id=1, eos_id=2, max_new_tokens=6)
    beam = beam_search(model, src, mask, beam_size=3, bos_id=1, eos_id=2, max_new_tokens=6)
    assert greedy == expected
    assert all(1 not in row for row in greedy + beam) and any(greedy) and any(beam)


def test_a_list_or_an_empty_source_is_refused_before_decoding(random_seq2seq, random_sources):
    """A list gave "'list' object has no attribute 'dim'"; an empty source, or a row masked out entirely, was decoded
    from nothing into tokens."""
    model = random_seq2seq()
    src, mask = random_sources([3, 2], vocab=32)
    empty_row = mask.clone()
    empty_row[1] = False
    for decode in (greedy_seq2seq, lambda *a, **k: beam_search(*a, beam_size=2, **k)):
        with pytest.raises(TypeError, match=r"src must be a \(batch, time\) tensor of token ids; got a list"):
            decode(model, src.tolist(), None, bos_id=1, eos_id=2, max_new_tokens=4)
        for source, source_mask in ((src[:, :0], None), (src, empty_row)):
            with pytest.raises(ValueError, match="every source needs at least one token"):
                decode(model, source, source_mask, bos_id=1, eos_id=2, max_new_tokens=4)


def test_a_wrong_model_is_a_type_error_that_names_the_right_one(random_seq2seq, random_lm, random_sources):
    src, mask = random_sources([3, 2], vocab=32)
    for decode in (greedy_seq2seq, lambda *a, **k: beam_search(*a, beam_size=2, **k)):
        with pytest.raises(TypeError, match=r"got a SimpleNamespace \(pass its \.model\)$"):
            decode(SimpleNamespace(model=random_seq2seq()), src, mask, bos_id=1, eos_id=2, max_new_tokens=4)
        with pytest.raises(TypeError, match=r"got a DecoderLM \(a DecoderLM continues prompts with generate\)$"):
            decode(random_lm(), src, mask, bos_id=1, eos_id=2, max_new_tokens=4)
