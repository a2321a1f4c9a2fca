"""Sampling from a decoder-only LM: the logit filters, the cache, left padding, seeds, stops, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tformer import DecoderLM, TransformerConfig
from tformer.sampling import (
    IncrementalLM,
    apply_temperature,
    filter_logits,
    generate,
    left_pad,
    top_k_filter,
    top_p_filter,
)
from tformer.tokenization import CharTokenizer

POSITIONS = ["sinusoidal", "rotary", "learned", "none"]
VOCAB = 32


def _model(position="rotary", dtype=torch.float32, seed=0, **changes) -> DecoderLM:
    """A tiny LM whose weights are large enough that its next-token distributions are far from uniform."""
    torch.manual_seed(seed)
    model = DecoderLM(TransformerConfig.tiny(position=position, **changes)).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


# --------------------------------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------------------------------
logit_rows = st.integers(2, 40).flatmap(
    lambda v: st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=v, max_size=v)
)


@settings(max_examples=200, deadline=None)
@given(row=logit_rows, k=st.integers(1, 45))
def test_top_k_keeps_exactly_the_k_largest(row, k):
    logits = torch.tensor([row], dtype=torch.float32)
    out = top_k_filter(logits, k)
    kept = torch.isfinite(out)
    assert int(kept.sum()) == min(k, len(row))
    assert torch.equal(out[kept], logits[kept])  # kept logits are untouched
    if (~kept).any():
        assert logits[kept].min() >= logits[~kept].max()  # nothing dropped beats anything kept


@settings(max_examples=300, deadline=None)
@given(row=logit_rows, p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_most_probable_set_with_mass_p(row, p):
    logits = torch.tensor([row], dtype=torch.float64)
    probs = logits.softmax(-1)[0]
    kept = torch.isfinite(top_p_filter(logits, p))[0]
    mass = float(probs[kept].sum())
    assert kept.any()  # at least one token, always
    assert mass >= p - 1e-9  # enough mass
    assert mass - float(probs[kept].min()) < p + 1e-9  # minimal: without its least likely token it falls short
    if (~kept).any():
        assert probs[kept].min() >= probs[~kept].max()  # the most probable tokens


def test_top_p_always_keeps_the_argmax_even_for_tiny_p():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0 - 1e-3]])
    out = top_p_filter(logits, 1e-6)
    assert torch.isfinite(out).tolist() == [[False, True, False, False]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_temperature_raises_probabilities_to_the_power_one_over_t():
    logits = torch.randn(3, 11, dtype=torch.float64)
    p = logits.softmax(-1)
    for t in (0.5, 2.0):
        expected = p ** (1 / t) / (p ** (1 / t)).sum(-1, keepdim=True)
        torch.testing.assert_close(apply_temperature(logits, t).softmax(-1), expected, rtol=1e-12, atol=1e-12)


def _support_at_each_step(model, prompt, new, **filters):
    """For each generated token: is it inside the filtered support of the full-forward logits at its step?"""
    seq = torch.tensor([prompt + new])
    logits = model(seq)[0, len(prompt) - 1 : -1]  # (N, V): the logits each new token was drawn from
    support = torch.isfinite(filter_logits(logits, **filters))
    return [bool(support[i, t]) for i, t in enumerate(new)]


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.5), dict(top_k=5, top_p=0.7, temperature=1.7)])
def test_generated_tokens_stay_inside_the_truncated_set(filters):
    model = _model(dtype=torch.float64)
    prompts = _prompts([5, 2, 8], seed=1)
    out = generate(model, prompts, max_new_tokens=40, seed=0, temperature=filters.get("temperature", 1.0),
                   top_k=filters.get("top_k"), top_p=filters.get("top_p"))  # fmt: skip
    with torch.no_grad():
        for prompt, new in zip(prompts, out):
            assert len(new) == 40
            assert all(_support_at_each_step(model, prompt, new, **filters))
        # the check has teeth: plain sampling at the same temperature leaves that set
        plain = generate(model, prompts, max_new_tokens=40, seed=0, temperature=filters.get("temperature", 1.0))
        assert not all(all(_support_at_each_step(model, p, n, **filters)) for p, n in zip(prompts, plain))


# --------------------------------------------------------------------------------------------------
# The cache and left padding
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position", POSITIONS)
def test_cached_logits_equal_uncached_during_generation(position):
    model = _model(position)
    prompts = _prompts([6, 3, 9], seed=2)
    ids, mask = left_pad(prompts, pad_id=0)
    with torch.no_grad():
        cached = IncrementalLM(model, ids, mask, max_new_tokens=12)
        full = IncrementalLM(model, ids, mask, max_new_tokens=12, use_cache=False)
        steps_cached, steps_full = [cached.prefill()], [full.prefill()]
        for _ in range(12):
            token = steps_cached[-1].argmax(-1)
            steps_cached.append(cached.step(token))
            steps_full.append(full.step(token))
        # float32, same math in a different order: 1e-5 is ~100 ulps of the logits' scale
        torch.testing.assert_close(torch.stack(steps_cached), torch.stack(steps_full), rtol=1e-5, atol=1e-5)
        # and each row against one plain forward of its own (unpadded) sequence
        for b, prompt in enumerate(prompts):
            seq = torch.tensor([prompt + cached.ids[b, ids.shape[1] : cached.length].tolist()])
            reference = model(seq)[0, len(prompt) - 1 :]  # (13, V)
            torch.testing.assert_close(torch.stack(steps_cached)[:, b], reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ["sinusoidal", "rotary", "learned"])
def test_left_padded_batch_gives_the_tokens_of_one_by_one(position):
    model = _model(position, dtype=torch.float64)
    prompts = _prompts([3, 7, 1, 5], seed=3)
    batched = generate(model, prompts, max_new_tokens=15, greedy=True)
    assert batched == [generate(model, [p], max_new_tokens=15, greedy=True)[0] for p in prompts]
    sampled = generate(model, prompts, max_new_tokens=15, seed=10, top_p=0.9)
    assert sampled == [
        generate(model, [p], max_new_tokens=15, seed=10 + i, top_p=0.9)[0] for i, p in enumerate(prompts)
    ]
    seeds = [4, 4, 9, 1]
    assert generate(model, prompts, max_new_tokens=15, seed=seeds) == [
        generate(model, [p], max_new_tokens=15, seed=s)[0] for p, s in zip(prompts, seeds)
    ]


def test_cache_and_no_cache_generate_the_same_tokens():
    model = _model("learned")
    prompts = _prompts([4, 9], seed=4)
    assert generate(model, prompts, max_new_tokens=20, greedy=True) == generate(
        model, prompts, max_new_tokens=20, greedy=True, use_cache=False
    )
    assert generate(model, prompts, max_new_tokens=20, seed=5) == generate(
        model, prompts, max_new_tokens=20, seed=5, use_cache=False
    )


def test_tensor_prompts_and_eval_mode_restored():
    model = _model(dropout=0.1)
    model.train()
    ids = torch.tensor(_prompts([6, 6], seed=5))
    out = generate(model, ids, max_new_tokens=8, greedy=True)
    assert model.training  # restored
    assert out == generate(model, ids.tolist(), max_new_tokens=8, greedy=True)  # dropout was off


# --------------------------------------------------------------------------------------------------
# Determinism and seeds
# --------------------------------------------------------------------------------------------------
def test_greedy_is_deterministic_and_is_the_argmax():
    model = _model()
    prompt = _prompts([5], seed=6)
    first = generate(model, prompt, max_new_tokens=20, greedy=True)
    assert first == generate(model, prompt, max_new_tokens=20, greedy=True)
    with torch.no_grad():
        logits = model(torch.tensor([prompt[0] + first[0]]))[0, len(prompt[0]) - 1 : -1]
    assert logits.argmax(-1).tolist() == first[0]


def test_same_seed_repeats_and_different_seeds_differ():
    model = _model()
    prompt = _prompts([5], seed=7)
    a = generate(model, prompt, max_new_tokens=30, seed=1)
    assert a == generate(model, prompt, max_new_tokens=30, seed=1)
    assert a != generate(model, prompt, max_new_tokens=30, seed=2)
    torch.manual_seed(0)  # seed=None draws from torch's global RNG
    b = generate(model, prompt, max_new_tokens=30)
    torch.manual_seed(0)
    assert b == generate(model, prompt, max_new_tokens=30)
    torch.manual_seed(1)
    assert b != generate(model, prompt, max_new_tokens=30)


# --------------------------------------------------------------------------------------------------
# Stops and lengths
# --------------------------------------------------------------------------------------------------
def _first(seq, sub):
    return next(i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub)


def test_max_new_tokens_is_respected():
    model = _model()
    prompts = _prompts([2, 4], seed=8)
    assert [len(r) for r in generate(model, prompts, max_new_tokens=17, seed=0)] == [17, 17]
    assert generate(model, prompts, max_new_tokens=0) == [[], []]


def test_eos_and_stop_sequences_end_generation_and_are_dropped():
    model = _model(dtype=torch.float64)
    prompts = _prompts([3, 6], seed=9)
    free = generate(model, prompts, max_new_tokens=30, greedy=True)
    eos = free[0][4]
    out = generate(model, prompts, max_new_tokens=30, greedy=True, eos_id=eos)
    for row, ref in zip(out, free):
        assert row == (ref[: ref.index(eos)] if eos in ref else ref)
    stop = free[1][6:8]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    out = generate(model, prompts, max_new_tokens=30, greedy=True, stop=[stop, [VOCAB - 1] * 5],
                   on_token=lambda b, t: streamed[b].append(t))  # fmt: skip
    for row, ref in zip(out, free):
        found = any(ref[i : i + 2] == stop for i in range(len(ref) - 1))
        assert row == (ref[: _first(ref, stop)] if found else ref)
    assert out[1] == free[1][: _first(free[1], stop)]  # row 1 certainly stopped
    assert [streamed[0], streamed[1]] == out  # the stream spells exactly the output: no stop token leaked


def test_stop_strings_cut_the_text_before_the_stop():
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz012345")  # 32 characters + <unk>: ids 0..31 are the letters
    model = _model(vocab_size=tok.vocab_size, dtype=torch.float64)
    prompt = [tok.encode("hello")]
    free = generate(model, prompt, max_new_tokens=40, greedy=True)[0]
    text = tok.decode(free)
    stop = text[10:13]
    shown: list[int] = []
    out = generate(model, prompt, max_new_tokens=40, greedy=True, stop=[stop], tokenizer=tok,
                   on_token=lambda b, t: shown.append(t))  # fmt: skip
    assert tok.decode(out[0]) == text[: text.index(stop)]
    assert shown == out[0]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompt_ids=[[]]), "prompt 0 is empty"),
        (dict(prompt_ids=[]), "at least one prompt"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(prompt_ids=[[1, VOCAB]]), f"token id {VOCAB}"),
        (dict(prompt_ids=[[1, -1]]), "token id -1"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(stop=["ab"]), "needs a tokenizer"),
        (dict(stop=[[]]), "must not be empty"),
        (dict(eos_id=VOCAB), "eos_id"),
        (dict(seed=[1, 2, 3]), "one seed per prompt"),
        (dict(prompt_ids=torch.zeros(1, 3)), "integer tensor"),
    ],
)
def test_bad_input_raises_clear_value_errors(kwargs, message):
    model = _model()
    args = dict(prompt_ids=[[1, 2]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, args.pop("prompt_ids"), **args)


def test_learned_positions_bound_prompt_plus_new_tokens():
    model = _model("learned", max_seq_len=16)
    assert len(generate(model, [[1] * 6], max_new_tokens=10, greedy=True)[0]) == 10  # exactly fits
    with pytest.raises(ValueError, match="max_seq_len=16"):
        generate(model, [[1] * 6, [2]], max_new_tokens=11, greedy=True)
    rotary = _model("rotary", max_seq_len=16)
    assert len(generate(rotary, [[1] * 6], max_new_tokens=20, greedy=True)[0]) == 20  # rotary extrapolates


def test_greedy_ignores_temperature():
    model = _model()
    prompt = _prompts([4], seed=11)
    assert generate(model, prompt, max_new_tokens=5, greedy=True, temperature=0.0) == generate(
        model, prompt, max_new_tokens=5, greedy=True
    )
