"""Decoding over a static KV cache (storage allocated once, written in place) and its compiled form: the same logits
and tokens as the growing cache, left-padded batches equal to one prompt at a time, and one compiled graph per shape
bucket: no recompilation per step (dynamo's own counters)."""

from __future__ import annotations

import pytest
import torch

from tformer import generate, quantize
from tformer.generation.sampling import IncrementalLM
from tformer.generation.static import StaticLM
from tformer.models import pad_left

FLOAT32 = 1e-5  # the bound for cached against uncached decoding in float32


@pytest.mark.parametrize("position", ["rotary", "learned", "sinusoidal"])
def test_static_cache_logits_equal_the_growing_cache(random_lm, random_prompts, position):
    model = random_lm(position=position)
    ids, mask = pad_left(random_prompts([3, 9, 6]), 0)
    with torch.inference_mode():
        grow = IncrementalLM(model, ids, mask, max_new_tokens=10)
        static = StaticLM(model, ids, mask, max_new_tokens=10, compile=False)
        a, b = grow.prefill(), static.prefill()
        assert (a - b).abs().max() < FLOAT32
        for _ in range(9):  # teacher-forced: both fed the same tokens
            token = a.argmax(-1)
            a, b = grow.step(token), static.step(token)
            assert (a - b).abs().max() < FLOAT32


@pytest.mark.parametrize("position", ["rotary", "learned"])
def test_a_left_padded_batch_equals_one_prompt_at_a_time(random_lm, random_prompts, position):
    model = random_lm(position=position)
    prompts = random_prompts([2, 8, 5])
    batch = generate(model, prompts, max_new_tokens=12, greedy=True, static_cache=True)
    alone = [generate(model, [p], max_new_tokens=12, greedy=True, static_cache=True)[0] for p in prompts]
    growing = generate(model, prompts, max_new_tokens=12, greedy=True)
    assert batch == alone == growing


def test_sampling_and_stops_work_over_the_static_cache(random_lm, random_prompts):
    model = random_lm()
    prompts = random_prompts([4, 6])
    kwargs = dict(max_new_tokens=15, seed=3, top_k=5, temperature=1.2)
    assert generate(model, prompts, static_cache=True, **kwargs) == generate(model, prompts, **kwargs)
    eos = generate(model, prompts, max_new_tokens=15, greedy=True)[0][4]
    assert generate(model, prompts, max_new_tokens=15, greedy=True, eos_id=eos, static_cache=True) == generate(
        model, prompts, max_new_tokens=15, greedy=True, eos_id=eos
    )


def test_a_static_cache_refuses_more_than_the_learned_positions(random_lm):
    model = random_lm(position="learned", max_seq_len=16)
    with pytest.raises(ValueError, match="exceeds the model's 16 learned positions"):
        generate(model, [[1, 2, 3]], max_new_tokens=20, static_cache=True)


@pytest.mark.slow
def test_compiled_decoding_gives_eager_tokens_and_compiles_once_per_bucket(random_lm, random_prompts):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = random_lm()
    prompts = random_prompts([3, 7])
    eager = generate(model, prompts, max_new_tokens=20, greedy=True)
    before = counters["stats"]["unique_graphs"]
    compiled = generate(model, prompts, max_new_tokens=20, greedy=True, compile=True)
    assert compiled == eager
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs == 2  # one prefill graph and one step graph for 19 steps: no recompilation per step
    # another prompt length and count in the same buckets (prompt <= 64, capacity 128): no new graph
    again = generate(model, random_prompts([5, 11], seed=1), max_new_tokens=30, greedy=True, compile=True)
    assert counters["stats"]["unique_graphs"] - before == graphs
    assert again == generate(model, random_prompts([5, 11], seed=1), max_new_tokens=30, greedy=True)
    # another model of the same structure: the graphs take the weights as inputs, so it reuses them
    other = random_lm(seed=1)
    assert generate(other, prompts, max_new_tokens=20, greedy=True, compile=True) == generate(
        other, prompts, max_new_tokens=20, greedy=True
    )
    assert counters["stats"]["unique_graphs"] - before == graphs


@pytest.mark.slow
def test_compiled_steps_after_the_first_still_run_each_models_own_graph(random_lm, random_prompts):
    """After its first step a static generation skips dynamo's full guard evaluation (``StaticLM.step``): only the
    guards that tell cached graphs apart run. Models that share the code object and every shape (float32, bfloat16
    on the matrix-vector kernel, int8; each with its own weights), compiled and run in turn, still each give their
    own eager tokens."""
    torch._dynamo.reset()
    prompts = random_prompts([4, 9])
    models = [random_lm(), random_lm(seed=1), random_lm(seed=2).bfloat16(), quantize(random_lm(seed=3).bfloat16())]
    eager = [generate(m, prompts, max_new_tokens=12, greedy=True, static_cache=True) for m in models]
    assert len({str(tokens) for tokens in eager}) == len(models)  # four different outputs to tell apart
    for _ in range(2):  # the second round finds every graph cached
        for model, tokens in zip(models, eager, strict=True):
            assert generate(model, prompts, max_new_tokens=12, greedy=True, compile=True) == tokens


@pytest.mark.slow
def test_compiled_steps_after_the_first_call_their_graph_without_dynamo(random_lm, random_prompts):
    """From the second step on, a compiled static generation calls its step graph directly (``StaticLM.replay``,
    taken from the first step's call): dynamo is not entered again. The graph reads the token, key mask, positions
    and slot that each step wrote in place, so every step's logits still equal eager decoding's (teacher-forced:
    both fed the same, changing tokens; float32, the issue's 1e-5)."""
    model = random_lm()
    ids, mask = pad_left(random_prompts([3, 9]), 0)
    with torch.inference_mode():
        eager = StaticLM(model, ids, mask, max_new_tokens=10, compile=False)
        compiled = StaticLM(model, ids, mask, max_new_tokens=10, compile=True)
        a, b = eager.prefill(), compiled.prefill()
        a, b = eager.step(a.argmax(-1)), compiled.step(a.argmax(-1))
        assert (a - b).abs().max() < FLOAT32 and compiled.replay is not None
        assert compiled.recorder.last is None  # the recorder keeps no reference to this generation's cache

        def entered(*args):
            raise AssertionError("a step after the first went through dynamo")

        compiled.forward = entered
        for _ in range(8):
            token = a.argmax(-1)
            a, b = eager.step(token), compiled.step(token)
            assert (a - b).abs().max() < FLOAT32


@pytest.mark.slow
def test_compiled_steps_through_dynamo_leave_no_reference_to_the_cache(random_lm, random_prompts, monkeypatch):
    """Without the replay (``static.REPLAY`` off, as ``benchmarks/decode.py`` measures it) every step goes through
    dynamo and the recorder notes each call; the step drops that note, so no generation's cache outlives it there."""
    from tformer.generation import static

    monkeypatch.setattr(static, "REPLAY", False)
    model = random_lm()
    ids, mask = pad_left(random_prompts([3, 9]), 0)
    with torch.inference_mode():
        lm = StaticLM(model, ids, mask, max_new_tokens=6, compile=True)
        token = lm.prefill().argmax(-1)
        for _ in range(4):
            token = lm.step(token).argmax(-1)
            assert lm.replay is None and lm.recorder.last is None


def test_a_static_cache_names_the_longest_max_new_tokens_that_fits(random_lm):
    model = random_lm(position="learned", max_seq_len=16)
    with pytest.raises(ValueError, match=r"lower max_new_tokens to <= 13 \(--max-new-tokens\)"):
        generate(model, [[1, 2, 3]], max_new_tokens=14, static_cache=True)
    assert len(generate(model, [[1, 2, 3]], max_new_tokens=13, static_cache=True)[0]) == 13  # the bound named fits
    with pytest.raises(ValueError, match="the prompt's 16 tokens already fill the model's 16 learned positions"):
        generate(model, [list(range(16))], max_new_tokens=1, compile=True)


def test_auto_compiles_only_where_the_sequence_fits_a_static_cache(random_lm, monkeypatch):
    """``auto_compile`` on a device it compiles on (CUDA; here the CPU stands in for it): a model with learned
    positions compiles only when prompt + new tokens fit its ``max_seq_len``, else it decodes over the growing
    cache, which slides its window (compile=True there is an error)."""
    from tformer.generation import static

    learned, rotary = random_lm(position="learned", max_seq_len=16), random_lm(max_seq_len=16)
    assert not static.auto_compile(learned, 10) and not static.auto_compile(rotary, 10)  # the CPU: never
    monkeypatch.setattr(static, "AUTO_COMPILE_DEVICES", ("cpu",))
    assert static.auto_compile(learned, 16) and not static.auto_compile(learned, 17)
    assert static.auto_compile(rotary, 17) and static.auto_compile(rotary, 10_000)  # no window: any length fits


@pytest.mark.slow
def test_compiling_a_model_does_not_keep_it_alive(random_lm, random_prompts):
    """The compiled function takes the model as an argument: once the caller drops a compiled model, nothing of
    tformer's (or dynamo's graphs, which take the weights as inputs) keeps it, and its memory is freed."""
    import gc
    import weakref

    model = random_lm()
    generate(model, random_prompts([3]), max_new_tokens=4, greedy=True, compile=True)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


@pytest.mark.slow
def test_past_dynamos_recompile_limit_the_error_names_the_fix(random_lm, random_prompts, monkeypatch):
    """With room for one graph (the limit lowered from RECOMPILE_LIMIT), a compiled generation, which needs two
    (prefill and step), fails with the cause and ``torch._dynamo.reset()``, not dynamo's bare limit error."""
    from tformer.generation import static

    torch._dynamo.reset()
    monkeypatch.setattr(static, "RECOMPILE_LIMIT", 1)
    model = random_lm()
    expected = r"at most 1 graphs.*batch size and shape bucket.*torch\._dynamo\.reset\(\)"
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(RuntimeError, match=expected):
        generate(model, random_prompts([3]), max_new_tokens=4, greedy=True, compile=True)
    torch._dynamo.reset()  # the next test's graphs start from nothing


def test_the_static_cache_is_allocated_before_any_graph_runs(random_lm):
    """Storage made inside a CUDA graph belongs to the graph's memory pool: compiled decoding on CUDA failed at its
    first step when the prefill's graph allocated the cache. StaticLM allocates every layer's keys and values first,
    in the model's dtype, and the forward writes into that storage."""
    model = random_lm(dtype=torch.bfloat16)
    ids, mask = pad_left([[1, 2, 3], [4, 5]], 0)
    lm = StaticLM(model, ids, mask, max_new_tokens=4, compile=False)
    shape = (2, model.cfg.kv_heads, lm.capacity, model.cfg.head_dim)
    before = [(layer.self_kv.k, layer.self_kv.v) for layer in lm.cache]
    assert all(k.shape == v.shape == shape and k.dtype == torch.bfloat16 for k, v in before)
    with torch.inference_mode():
        lm.prefill()
    assert all(layer.self_kv.k is k and layer.self_kv.v is v for layer, (k, v) in zip(lm.cache, before, strict=True))
    assert all(k[:, :, :3].abs().sum() > 0 for k, _ in before)  # the prompt's keys landed in it
