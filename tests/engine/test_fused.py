"""A decode step of Llama-style blocks as one kernel call (``tformer.engine.fused``, ``tformer::decode_blocks``): it
computes what the modules compute (float32: up to the order of float32 additions; bfloat16 and int8: erring against a
float64 oracle no more than twice what the modules' path errs), writes the same cache, runs exactly where it should, and
compiles into a graph of one call for all blocks."""

from __future__ import annotations

import copy

import pytest
import torch

from tformer import DecoderLM, TransformerConfig, generate, quantize
from tformer.engine import fused, kernels
from tformer.generation.static import StaticLM, static_cache
from tformer.models import pad_left

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernels_built")]
FLOAT32 = 1e-5  # the library's bound for two float32 paths that differ in the order of their additions
LLAMA = dict(position="rotary", norm="rms", ffn="gated", activation="silu", bias=False)


def llama(dtype=torch.float32, seed: int = 0, **changes) -> DecoderLM:
    """A tiny Llama-style model (RMSNorm, SwiGLU, RoPE) with unit-scale random weights: a norm or activation mistake
    shows, where the 0.02 initialization would hide it."""
    torch.manual_seed(seed)
    model = DecoderLM(TransformerConfig.tiny(**{**LLAMA, **changes})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)  # norm gains near 1, not all exactly 1
    return model.to(dtype)


def decode(model: DecoderLM, on: bool, lengths=(3, 9, 6), steps: int = 8, calls: list | None = None):
    """Logits (float64) of a left-padded batch's prefill and ``steps`` teacher-forced decode steps over a static
    cache, the fused step on or off; and the cache's keys and values at the end."""
    ids, mask = pad_left([list(range(2, 2 + n)) for n in lengths], 0)
    g = torch.Generator().manual_seed(1)
    with fused.enabled(on), torch.inference_mode():
        lm = StaticLM(model, ids, mask, max_new_tokens=steps + 1, compile=False)
        out = [lm.prefill().double()]
        for _ in range(steps):
            out.append(lm.step(torch.randint(0, model.cfg.vocab_size, (ids.shape[0],), generator=g)).double())
        cache = [(layer.self_kv.k.double(), layer.self_kv.v.double()) for layer in lm.cache]
    return torch.stack(out), cache


def counting(monkeypatch) -> list:
    calls = []
    step = fused.step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(fused, "step", counted)
    return calls


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("kv_heads", [None, 1])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_a_fused_float32_step_computes_what_the_modules_do(monkeypatch, layout, kv_heads, qkv_bias):
    model = llama(pair_layout=layout, num_kv_heads=kv_heads, qkv_bias=qkv_bias)
    calls = counting(monkeypatch)
    on, on_cache = decode(model, True)
    assert len(calls) == 8  # every decode step, all blocks in one call; prefill (9 tokens) not
    off, off_cache = decode(model, False)
    assert len(calls) == 8
    assert (on - off).abs().max() < FLOAT32
    for (k1, v1), (k2, v2) in zip(on_cache, off_cache, strict=True):  # the same keys and values written
        assert (k1 - k2).abs().max() < FLOAT32 and (v1 - v2).abs().max() < FLOAT32


def test_a_fused_bfloat16_step_errs_no_more_than_twice_the_modules_path():
    base = llama(num_kv_heads=2, qkv_bias=True)
    model = copy.deepcopy(base).bfloat16()
    oracle = decode(copy.deepcopy(model).double(), False)[0]  # the bfloat16 weights, computed in float64
    error = {on: (decode(model, on)[0] - oracle).abs().max() for on in (True, False)}
    assert error[True] <= 2 * error[False]  # bfloat16 roundings dominate both paths
    assert error[False] > 0  # a path that computed in float64 would make the bound meaningless


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_blocks_fuse_within_the_same_bounds(monkeypatch, dtype):
    model = quantize(llama(num_kv_heads=2).to(dtype))
    calls = counting(monkeypatch)
    on = decode(model, True)[0]
    assert len(calls) == 8
    off = decode(model, False)[0]
    if dtype == torch.float32:
        assert (on - off).abs().max() < FLOAT32
    else:  # the oracle: the same codes and scales in float64 (Int8Linear dequantizes for float64 inputs)
        oracle = decode(copy.deepcopy(model).double(), False)[0]
        assert (on - oracle).abs().max() <= 2 * (off - oracle).abs().max()


@pytest.mark.parametrize("int8", [False, True])
def test_sixteen_bfloat16_rows_fuse_in_int8_and_where_bfloat16_gemms_run_as_float32(monkeypatch, int8):
    """max_rows(bfloat16) rows: WIDE_ROWS where bfloat16 GEMMs run as float32 (forced on here, so that any CPU checks
    it), a left-padded batch of 16 fused within twice the modules' error against float64; with the route off, 16
    bfloat16 rows are past MAX_ROWS: the modules; but int8 codes take 16 rows on any CPU (max_rows(int8)): fused."""
    model = llama(num_kv_heads=2).bfloat16()
    model = quantize(model) if int8 else model
    lengths = tuple(3 + r % 7 for r in range(kernels.WIDE_ROWS))  # prompts of 3 to 9 tokens
    calls = counting(monkeypatch)
    with kernels.float32_gemms(True):
        on = decode(model, True, lengths)[0]
        assert len(calls) == 8
        off = decode(model, False, lengths)[0]
    oracle = decode(copy.deepcopy(model).double(), False, lengths)[0]
    assert (on - oracle).abs().max() <= 2 * (off - oracle).abs().max()
    with kernels.float32_gemms(False):
        route_off = decode(model, True, lengths)[0]
    assert len(calls) == (16 if int8 else 8)
    assert (route_off - oracle).abs().max() <= 2 * (off - oracle).abs().max()


def test_generation_over_the_fused_step_gives_the_modules_tokens(random_prompts):
    model = llama(num_kv_heads=2)
    prompts = [[5], *random_prompts([2, 8, 5])]  # a one-token prompt: its prefill is a fused step too
    with fused.enabled(True):
        batch = generate(model, prompts, max_new_tokens=12, greedy=True, static_cache=True)
        alone = [generate(model, [p], max_new_tokens=12, greedy=True, static_cache=True)[0] for p in prompts]
    with fused.enabled(False):
        modules = generate(model, prompts, max_new_tokens=12, greedy=True, static_cache=True)
    growing = generate(model, prompts, max_new_tokens=12, greedy=True)  # the growing cache: never fused
    assert batch == alone == modules == growing


def test_the_fused_step_runs_only_where_it_computes_the_same_function():
    model = llama()
    blocks = model.decoder.stack.blocks
    assert all(fused.fits(block) for block in blocks)
    for changes in (
        dict(norm="layer"),
        dict(ffn="mlp"),
        dict(activation="gelu"),
        dict(norm_first=False),
        dict(position="learned"),
        dict(attn_backend="tiled"),  # a backend asked for by name is kept
    ):
        other = llama(**changes)
        assert not any(fused.fits(block) for block in other.decoder.stack.blocks), changes
    cache = static_cache(model, 16)
    for layer in cache:
        layer.self_kv.slots = torch.zeros(1, dtype=torch.long)  # a column of its own: not the one step of all blocks
    x = torch.zeros(2, 1, model.cfg.d_model)
    with torch.no_grad():
        assert not fused.applies(blocks, x, cache)
        slot = torch.zeros(1, dtype=torch.long)
        for layer in cache:
            layer.self_kv.slots = slot  # one column for every block, as StaticLM writes
        assert fused.applies(blocks, x, cache)
        assert not fused.applies(blocks, torch.zeros(2, 2, model.cfg.d_model), cache)  # a prompt: two tokens
        assert not fused.applies(blocks, torch.zeros(kernels.MAX_ROWS + 1, 1, model.cfg.d_model), cache)
        assert not fused.applies(blocks, x.double(), cache)
        with kernels.enabled(False):
            assert not fused.applies(blocks, x, cache)
    assert not fused.applies(blocks, x, cache)  # autograd on and the parameters require gradients
    model.train()
    with torch.no_grad():
        assert not fused.applies(blocks, x, cache)


def test_the_op_refuses_mismatched_arguments_by_name():
    model = llama()
    block = model.decoder.stack.blocks[0]
    cache = static_cache(model, 8)[0].self_kv
    cache.slots = torch.tensor([8])
    keys = torch.ones(1, 8, dtype=torch.bool)
    D = model.cfg.d_model // model.cfg.num_heads
    rope = (torch.ones(1, D // 2), torch.zeros(1, D // 2))
    x = torch.zeros(1, 1, model.cfg.d_model)
    with torch.no_grad(), pytest.raises(RuntimeError, match="slot 8 outside the cache's 8 columns"):
        fused.step(fused.arguments([block], x.dtype), x, [cache], keys, rope)
    cache.slots = torch.tensor([0])
    with torch.no_grad(), pytest.raises(RuntimeError, match="block 1's qkv weight is Double, the activations Float"):
        model.decoder.stack.blocks[1].self_attn.in_proj.double()
        fused.step(fused.arguments(model.decoder.stack.blocks[:2], x.dtype), x, [cache, cache], keys, rope)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"2 norm weights and 2 eps a block \(2 for 1 blocks\)"):
        fused.step(fused.arguments(model.decoder.stack.blocks[:2], x.dtype), x, [cache], keys, rope)


@pytest.mark.slow
def test_a_compiled_step_is_one_call_for_the_blocks_and_gives_eager_tokens(random_prompts):
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    model = llama(num_kv_heads=2).bfloat16()
    prompts = random_prompts([3, 7])
    eager = generate(model, prompts, max_new_tokens=20, greedy=True, static_cache=True)
    before = counters["stats"]["unique_graphs"]
    assert generate(model, prompts, max_new_tokens=20, greedy=True, compile=True) == eager
    assert counters["stats"]["unique_graphs"] - before == 2  # prefill and step: no recompilation per step
    ids, mask = pad_left(prompts, 0)
    with torch.inference_mode():
        lm = StaticLM(model, ids, mask, max_new_tokens=4, compile=True)
        token = lm.prefill().argmax(-1)
        token = lm.step(token).argmax(-1)  # the first step: dynamo's guards, then the graph is called directly
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            lm.step(token)
    names = [event.name for event in prof.events()]
    assert names.count("tformer::decode_blocks") == 1
    assert "tformer::decode_attention" not in names and "aten::rms_norm" not in names


def test_sample_decodes_over_a_static_cache_exactly_where_blocks_fuse():
    from tformer.generation.static import auto_static_cache

    assert auto_static_cache(llama())
    assert auto_static_cache(llama(), length=64) and not auto_static_cache(llama(), length=65)  # its max_seq_len
    assert auto_static_cache(quantize(llama().bfloat16()))
    assert not auto_static_cache(DecoderLM(TransformerConfig.tiny()))  # GPT-style: LayerNorm, a plain feed-forward
    assert not auto_static_cache(llama().half())  # float16: no kernel runs its blocks (fused.plan)
    with kernels.enabled(False):
        assert not auto_static_cache(llama())
