"""Sampling from a decoder-only LM: the logit filters, the cache, left padding, seeds, stops, bad input."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tformer.generation.sampling import (
    IncrementalLM,
    SamplingRule,
    apply_temperature,
    filter_logits,
    generate,
    sample,
    top_k_filter,
    top_p_filter,
)
from tformer.models import pad_left
from tformer.tokenizers import CharTokenizer

POSITIONS = ["sinusoidal", "rotary", "learned", "none"]
VOCAB = 32


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


@pytest.mark.parametrize(
    "dtype,temperature",
    [(torch.float32, 1e-40), (torch.float32, 1e-50), (torch.float16, 1e-9), (torch.float64, 1e-320)],
)
def test_tiny_temperature_gives_greedy_not_nan(dtype, temperature):
    # z / T overflows to inf (and T itself rounds to 0 in the dtype for 1e-50, 1e-9 in float16)
    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0], [4.0, 4.0, 0.5, 1.0]], dtype=dtype)
    probs = apply_temperature(logits, temperature).softmax(-1)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]  # the argmax (ties shared)
    assert sample(apply_temperature(logits, temperature))[0] == 1


def _support_at_each_step(model, prompt, new, **filters):
    """For each generated token: is it inside the filtered support of the full-forward logits at its step?"""
    seq = torch.tensor([prompt + new])
    logits = model(seq)[0, len(prompt) - 1 : -1]  # (N, V): the logits each new token was drawn from
    support = torch.isfinite(filter_logits(logits, **filters))
    return [bool(support[i, t]) for i, t in enumerate(new)]


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.5), dict(top_k=5, top_p=0.7, temperature=1.7)])
def test_generated_tokens_stay_inside_the_truncated_set(random_lm, random_prompts, filters):
    model = random_lm(dtype=torch.float64)
    prompts = random_prompts([5, 2, 8], seed=1)
    out = generate(
        model,
        prompts,
        max_new_tokens=40,
        seed=0,
        temperature=filters.get("temperature", 1.0),
        top_k=filters.get("top_k"),
        top_p=filters.get("top_p"),
    )
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
def test_cached_logits_equal_uncached_during_generation(random_lm, random_prompts, position):
    model = random_lm(position)
    prompts = random_prompts([6, 3, 9], seed=2)
    ids, mask = pad_left(prompts, pad_id=0)
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
def test_left_padded_batch_gives_the_tokens_of_one_by_one(random_lm, random_prompts, position):
    model = random_lm(position, dtype=torch.float64)
    prompts = random_prompts([3, 7, 1, 5], seed=3)
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


def test_cache_and_no_cache_generate_the_same_tokens(random_lm, random_prompts):
    model = random_lm("learned")
    prompts = random_prompts([4, 9], seed=4)
    assert generate(model, prompts, max_new_tokens=20, greedy=True) == generate(
        model, prompts, max_new_tokens=20, greedy=True, use_cache=False
    )
    assert generate(model, prompts, max_new_tokens=20, seed=5) == generate(
        model, prompts, max_new_tokens=20, seed=5, use_cache=False
    )


def test_tensor_prompts_and_eval_mode_restored(random_lm, random_prompts):
    model = random_lm(dropout=0.1)
    model.train()
    ids = torch.tensor(random_prompts([6, 6], seed=5))
    out = generate(model, ids, max_new_tokens=8, greedy=True)
    assert model.training  # restored
    assert out == generate(model, ids.tolist(), max_new_tokens=8, greedy=True)  # dropout was off


def test_text_instead_of_token_ids_is_a_type_error_that_says_how_to_encode(random_lm):
    model = random_lm()
    with pytest.raises(TypeError, match=r"not the text 'hello': pass \[tokenizer.encode\(text\)\]"):
        generate(model, "hello", max_new_tokens=2)
    with pytest.raises(TypeError, match="not texts: pass \\[tokenizer.encode\\(t\\) for t in texts\\]"):
        generate(model, ["hello"], max_new_tokens=2)
    assert (
        generate(model, ([1, 2], (3,)), max_new_tokens=1, greedy=True)[1]
        == generate(model, [[3]], max_new_tokens=1, greedy=True)[0]
    )  # any sequences of ints still work


def test_a_wrong_model_is_a_type_error_that_names_the_right_one(random_lm, random_seq2seq):
    """What load_pretrained and load_checkpoint return holds the model as .model; passing the holder was answered
    with a hint about encoder-decoders."""
    with pytest.raises(
        TypeError, match=r"^generate continues prompts with a DecoderLM; got a SimpleNamespace \(pass its \.model\)$"
    ):
        generate(SimpleNamespace(model=random_lm(), tokenizer=None), [[1, 2]], max_new_tokens=2)
    with pytest.raises(
        TypeError, match=r"got a EncoderDecoder \(an EncoderDecoder decodes with greedy_seq2seq or beam_search\)$"
    ):
        generate(random_seq2seq(), [[1, 2]], max_new_tokens=2)


# --------------------------------------------------------------------------------------------------
# Determinism and seeds
# --------------------------------------------------------------------------------------------------
def test_greedy_is_deterministic_and_is_the_argmax(random_lm, random_prompts):
    model = random_lm()
    prompt = random_prompts([5], seed=6)
    first = generate(model, prompt, max_new_tokens=20, greedy=True)
    assert first == generate(model, prompt, max_new_tokens=20, greedy=True)
    with torch.no_grad():
        logits = model(torch.tensor([prompt[0] + first[0]]))[0, len(prompt[0]) - 1 : -1]
    assert logits.argmax(-1).tolist() == first[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_rule_picks_the_first_of_tied_maxima(dtype):
    """``SamplingRule.pick`` takes ``max``'s indices (faster than ``argmax`` on the CPU): the same first maximum,
    checked on rows of many ties (values 0..3 over 1000 columns, the maximum's first column anywhere)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (200, 1000), generator=g).to(dtype)
    first = (logits == logits.amax(-1, keepdim=True)).int().argmax(-1)  # the first True of each row
    assert torch.equal(SamplingRule(1.0, None, None, True, None).pick(logits), first)


def test_same_seed_repeats_and_different_seeds_differ(random_lm, random_prompts):
    model = random_lm()
    prompt = random_prompts([5], seed=7)
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


def test_max_new_tokens_is_respected(random_lm, random_prompts):
    model = random_lm()
    prompts = random_prompts([2, 4], seed=8)
    assert [len(r) for r in generate(model, prompts, max_new_tokens=17, seed=0)] == [17, 17]
    assert generate(model, prompts, max_new_tokens=0) == [[], []]


def test_eos_and_stop_sequences_end_generation_and_are_dropped(random_lm, random_prompts):
    model = random_lm(dtype=torch.float64)
    prompts = random_prompts([3, 6], seed=9)
    free = generate(model, prompts, max_new_tokens=30, greedy=True)
    eos = free[0][4]
    out = generate(model, prompts, max_new_tokens=30, greedy=True, eos_id=eos)
    for row, ref in zip(out, free):
        assert row == (ref[: ref.index(eos)] if eos in ref else ref)
    stop = free[1][6:8]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    out = generate(
        model,
        prompts,
        max_new_tokens=30,
        greedy=True,
        stop=[stop, [VOCAB - 1] * 5],
        on_token=lambda b, t: streamed[b].append(t),
    )
    for row, ref in zip(out, free):
        found = any(ref[i : i + 2] == stop for i in range(len(ref) - 1))
        assert row == (ref[: _first(ref, stop)] if found else ref)
    assert out[1] == free[1][: _first(free[1], stop)]  # row 1 certainly stopped
    assert [streamed[0], streamed[1]] == out  # the stream spells exactly the output: no stop token leaked


def test_stop_strings_cut_the_text_before_the_stop(random_lm):
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz012345")  # 32 characters + <unk>: ids 0..31 are the letters
    model = random_lm(vocab_size=tok.vocab_size, dtype=torch.float64)
    prompt = [tok.encode("hello")]
    free = generate(model, prompt, max_new_tokens=40, greedy=True)[0]
    text = tok.decode(free)
    stop = text[10:13]
    shown: list[int] = []
    out = generate(
        model, prompt, max_new_tokens=40, greedy=True, stop=[stop], tokenizer=tok, on_token=lambda b, t: shown.append(t)
    )
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
        (dict(temperature=float("inf")), r"temperature \(--temperature\) must be a finite number > 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(seed=-1), r"seed \(--seed\) must be an integer in \[0, 2\*\*63 - 1 = 9223372036854775807\]; got -1"),
        (dict(seed=10**20), r"seed \(--seed\) must be an integer in \[0, 2\*\*63 - 1"),
        (
            dict(prompt_ids=[[1], [2]], seed=[0, 2**63]),
            r"seed \(--seed\) must be an integer .*; got 9223372036854775808",
        ),
        (dict(prompt_ids=[[1], [2]], seed=2**63 - 1), r"\(row 1 of the batch draws with seed \+ 1\)"),
        (dict(seed=1.5), r"seed \(--seed\) must be an integer or a list of integers; got 1.5"),
        (dict(prompt_ids=torch.zeros(1, 3)), "integer tensor"),
        (dict(prompt_ids=[[1.0, 2.5]]), r"prompt 0 holds 1.0, which is not a token id: ids are integers"),
        (dict(prompt_ids=[[1], [2, True]]), r"prompt 1 holds True, which is not a token id"),
        (dict(prompt_ids=[[1, torch.tensor(2.0)]]), r"prompt 0 holds tensor\(2.\), which is not a token id"),
        (dict(eos_id="12"), r"eos_id must be a token id or a list of them; got '12'"),  # int() of each: ids 1, 2
        (dict(eos_id=[3.7]), r"eos_id holds 3.7, which is not a token id"),  # int() truncated it to 3
        (dict(eos_id=5.0), r"eos_id must be a token id or a list of them; got 5.0"),
        (dict(stop=[3]), r"stop holds 3; each stop is a string or a list of token ids \(one id: stop=\[\[3\]\]\)"),
        (dict(stop=[[1, VOCAB]]), rf"a stop sequence's id {VOCAB} is outside the vocabulary"),  # could never match
        (dict(stop=["a"], tokenizer="x"), "needs a tokenizer"),
    ],
)
def test_bad_input_raises_clear_value_errors(random_lm, kwargs, message):
    model = random_lm()
    args = dict(prompt_ids=[[1, 2]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, args.pop("prompt_ids"), **args)


def test_token_ids_may_be_any_integers_and_greedy_ignores_the_sampling_settings(random_lm):
    import numpy as np

    model = random_lm()
    first = generate(model, [[1, 2]], max_new_tokens=4, greedy=True)
    assert generate(model, [[np.int64(1), torch.tensor(2)]], max_new_tokens=4, greedy=True) == first
    assert generate(model, [[1, 2]], max_new_tokens=4, greedy=True, temperature=0.0, top_k=0, top_p=7.0) == first
    np_eos = generate(model, [[1, 2]], max_new_tokens=4, greedy=True, eos_id=np.int64(first[0][1]))
    assert np_eos == generate(model, [[1, 2]], max_new_tokens=4, greedy=True, eos_id=torch.tensor(first[0][1]))
    assert np_eos == [first[0][:1]]
    sampled = generate(model, [[1, 2]], max_new_tokens=np.int64(4), top_k=np.int64(3), seed=5)
    assert sampled == generate(model, [[1, 2]], max_new_tokens=4, top_k=3, seed=5)
    for name, value in (("temperature", "hot"), ("top_p", "0.9")):
        with pytest.raises(TypeError, match=rf"{name} \(--{name.replace('_', '-')}\) must be a number; got '"):
            generate(model, [[1, 2]], max_new_tokens=4, **{name: value})


def test_a_lone_stop_string_is_one_stop_not_one_per_character(random_lm):
    """``stop="ab"`` iterated as ``["a", "b"]`` ended rows at either character."""
    from tformer.tokenizers import CharTokenizer

    model = random_lm()
    tokenizer = CharTokenizer([chr(ord("a") + i) for i in range(VOCAB)], unknown="error")
    free = tokenizer.decode(generate(model, [[1, 2]], max_new_tokens=30, seed=1)[0])
    stop = next(free[i : i + 2] for i in range(1, 29) if free[i] in free[:i])  # its first character came before
    one = tokenizer.decode(generate(model, [[1, 2]], max_new_tokens=30, seed=1, stop=stop, tokenizer=tokenizer)[0])
    assert one == free[: free.index(stop)] and len(one) > free.index(stop[0])  # per character it ended sooner


@pytest.mark.parametrize("position", ["rotary", "learned"])
def test_the_growing_cache_takes_memory_for_the_tokens_made_not_for_max_new_tokens(random_lm, position):
    from tformer.generation.sampling import IncrementalLM

    GROW = IncrementalLM.GROW

    model = random_lm(position)
    first = generate(model, [[1, 2, 3]], max_new_tokens=1, greedy=True)[0][0]
    assert generate(model, [[1, 2, 3]], max_new_tokens=10**12, greedy=True, eos_id=first) == [[]]  # no 8 TB buffer
    lm = IncrementalLM(
        model,
        torch.tensor([[0, 1, 2], [5, 1, 2]]),
        torch.tensor([[False, True, True]] + [[True] * 3]),
        max_new_tokens=10**12,
    )
    lm.prefill()
    for _ in range(GROW + 5):  # past the first width: the buffers double
        lm.step(torch.tensor([4, 4]))
    assert lm.ids.shape[1] == lm.mask.shape[1] == 2 * (3 + GROW) and lm.length == 3 + GROW + 5
    seen = lm.mask[:, : lm.length]
    if position == "rotary":  # no window: the prompt (row 0 padded), then every token made
        assert seen[:, 3:].all() and seen[:, :3].tolist() == [[False, True, True], [True, True, True]]
    else:  # 64 learned positions: each row sees what it made since its last restart
        assert min(lm.starts) > 3 and seen.sum(-1).tolist() == [lm.length - start for start in lm.starts]


def test_growing_and_static_caches_give_the_same_long_left_padded_generations(random_lm):
    from tformer.generation.sampling import IncrementalLM

    GROW = IncrementalLM.GROW

    model, prompts = random_lm(), [[1, 2, 3, 4, 5], [6, 7]]
    growing = generate(model, prompts, max_new_tokens=2 * GROW + 40, greedy=True)  # across two doublings
    assert growing == generate(model, prompts, max_new_tokens=2 * GROW + 40, greedy=True, static_cache=True)
    assert growing[1] == generate(model, [prompts[1]], max_new_tokens=2 * GROW + 40, greedy=True)[0]


def test_a_static_cache_larger_than_the_machine_is_refused_before_allocating(random_lm):
    with pytest.raises(
        ValueError, match=r"a static cache of 1000000000003 positions for 1 row needs [\d.]+ GiB, more "
    ):
        generate(random_lm(), [[1, 2, 3]], max_new_tokens=10**12, static_cache=True)


def test_the_static_cache_is_checked_against_the_memory_available_not_installed(random_lm, tmp_path, monkeypatch):
    """Linux's MemAvailable (free memory and droppable caches) is what a new cache can take without swapping; the
    machine's physical memory only where the OS has no such line."""
    import os

    from tformer.generation import static

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:     200000 kB\n")
    assert static._available_memory(str(meminfo)) == (200000 * 1024, "available")
    installed = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert static._available_memory(str(tmp_path / "missing")) == (installed, "in all")
    monkeypatch.setattr(static, "_available_memory", lambda: (4096, "available"))
    with pytest.raises(ValueError, match=r"more than the 0\.0 GiB of memory available; lower max_new_tokens"):
        generate(
            random_lm(), [[1, 2, 3]], max_new_tokens=100, static_cache=True
        )  # 52,736 bytes: K and V x 2 layers x 103 positions x 32 x 4 bytes


def test_bad_seed_is_an_error_even_when_nothing_is_generated(random_lm):
    with pytest.raises(ValueError, match="--seed"):
        generate(random_lm(), [[1, 2]], max_new_tokens=0, seed=-1)


def test_largest_seed_is_accepted_and_reproducible(random_lm):
    model = random_lm()
    first = generate(model, [[1, 2]], max_new_tokens=6, seed=2**63 - 1)
    assert first == generate(model, [[1, 2]], max_new_tokens=6, seed=[2**63 - 1])


def test_infinite_temperature_is_rejected_by_the_filter_too():
    with pytest.raises(ValueError, match="finite"):
        apply_temperature(torch.zeros(1, 4), float("inf"))


def test_every_position_scheme_generates_past_max_seq_len(random_lm):
    for position in POSITIONS:
        model = random_lm(position, max_seq_len=16)
        out = generate(model, [[1] * 20, [2] * 3], max_new_tokens=40, greedy=True)  # a prompt beyond 16, too
        assert [len(row) for row in out] == [40, 40]


def test_sampling_nan_logits_raises_a_clear_error(random_lm):
    model = random_lm()
    with torch.no_grad():
        model.decoder.stack.blocks[0].ff.up.weight[0, 0] = float("nan")  # a diverged checkpoint
    for seed in (0, None):
        with pytest.raises(ValueError, match="NaN .*logits.*diverged"):
            generate(model, [[1, 2], [3]], max_new_tokens=3, seed=seed, top_k=5)
    with pytest.raises(ValueError, match="NaN"):
        sample(torch.tensor([[float("inf"), 1.0]]))  # softmax of +inf is NaN as well
    assert sample(torch.tensor([[float("-inf"), 1.0]])).tolist() == [1]  # -inf is just probability 0


@pytest.mark.parametrize("stops", [False, True])  # the block decoder, and the row-by-row one (stops, streaming)
def test_greedy_on_a_nan_model_raises_instead_of_returning_garbage(random_lm, stops):
    model = random_lm()
    with torch.no_grad():
        model.decoder.stack.blocks[0].ff.up.weight[0, 0] = float("nan")
    extra = dict(eos_id=3, on_token=lambda row, tok: None) if stops else {}
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="NaN .*logits.*diverged"):
            generate(model, [[1, 2], [3]], max_new_tokens=3, greedy=True, use_cache=use_cache, **extra)


def test_temperature_zero_message_names_the_api_and_the_cli(random_lm):
    with pytest.raises(ValueError, match=r"greedy=True, --greedy"):
        generate(random_lm(), [[1]], max_new_tokens=2, temperature=0.0)


# --------------------------------------------------------------------------------------------------
# The sliding context window of learned positions
# --------------------------------------------------------------------------------------------------
def _window_spans(prompt_len, steps, W):
    """``(start, end)`` of the tokens the model sees before each new token of one row: the module docstring's rule
    written out plainly, for one row alone."""
    start, end = max(0, prompt_len - W), prompt_len
    spans = [(start, end)]
    for _ in range(steps):
        end += 1
        if end - start > W:
            start = end - max(1, W // 2)
        spans.append((start, end))
    return spans


@pytest.mark.parametrize("lengths,W", [([3, 11, 1, 6], 8), ([5, 5], 7), ([2, 4], 1)])
def test_window_restarts_cached_equal_uncached_equal_each_rows_own_window(random_lm, random_prompts, lengths, W):
    model = random_lm("learned", max_seq_len=W)
    prompts = random_prompts(lengths, seed=12)
    ids, mask = pad_left(prompts, pad_id=0)
    steps = 30
    with torch.no_grad():
        cached = IncrementalLM(model, ids, mask, max_new_tokens=steps)
        full = IncrementalLM(model, ids, mask, max_new_tokens=steps, use_cache=False)
        steps_cached, steps_full = [cached.prefill()], [full.prefill()]
        for _ in range(steps):
            token = steps_cached[-1].argmax(-1)
            steps_cached.append(cached.step(token))
            steps_full.append(full.step(token))
        logits = torch.stack(steps_cached)  # (steps + 1, B, V)
        torch.testing.assert_close(logits, torch.stack(steps_full), rtol=1e-5, atol=1e-5)
        for b, prompt in enumerate(prompts):
            seq = prompt + cached.ids[b, ids.shape[1] : cached.length].tolist()
            spans = _window_spans(len(prompt), steps, W)
            assert max(end - start for start, end in spans) == min(W, max(lengths) + steps)  # never beyond W
            assert len({start for start, _ in spans}) >= 5  # several restarts
            reference = torch.stack([model(torch.tensor([seq[start:end]]))[0, -1] for start, end in spans])
            torch.testing.assert_close(logits[:, b], reference, rtol=1e-5, atol=1e-5)


def test_window_left_padded_batch_crossing_restarts_gives_the_tokens_of_one_by_one(random_lm, random_prompts):
    model = random_lm("learned", dtype=torch.float64, max_seq_len=8)
    prompts = random_prompts([3, 10, 1, 6], seed=13)  # rows restart at different steps; row 1 starts cropped
    batched = generate(model, prompts, max_new_tokens=25, greedy=True)
    assert batched == [generate(model, [p], max_new_tokens=25, greedy=True)[0] for p in prompts]
    assert batched == generate(model, prompts, max_new_tokens=25, greedy=True, use_cache=False)
    sampled = generate(model, prompts, max_new_tokens=25, seed=20, top_p=0.9)
    assert sampled == [
        generate(model, [p], max_new_tokens=25, seed=20 + i, top_p=0.9)[0] for i, p in enumerate(prompts)
    ]
    assert sampled == generate(model, prompts, max_new_tokens=25, seed=20, top_p=0.9, use_cache=False)


def test_window_crops_a_long_prompt_to_its_last_max_seq_len_tokens(random_lm, random_prompts):
    model = random_lm("learned", dtype=torch.float64, max_seq_len=8)
    prompt = random_prompts([21], seed=14)[0]
    out = generate(model, [prompt], max_new_tokens=12, greedy=True)[0]
    assert out == generate(model, [prompt[-8:]], max_new_tokens=12, greedy=True)[0]
    assert out != generate(model, [prompt[-7:]], max_new_tokens=12, greedy=True)[0]  # the 8th-last token counts
    with torch.no_grad():  # the first token: the argmax after the last 8 prompt tokens
        assert out[0] == int(model(torch.tensor([prompt[-8:]]))[0, -1].argmax())


def test_greedy_ignores_temperature(random_lm, random_prompts):
    model = random_lm()
    prompt = random_prompts([4], seed=11)
    assert generate(model, prompt, max_new_tokens=5, greedy=True, temperature=0.0) == generate(
        model, prompt, max_new_tokens=5, greedy=True
    )
