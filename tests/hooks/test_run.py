"""Running with hooks: nothing changes when none is attached (bit for bit, also after an error inside a hook); what a
hook returns is what the rest of the forward uses; bad hooks and names get errors naming the fix; the cache holds
exactly what was asked; ``stop_at_layer`` ends at the residual stream entering a block; and hooks fire while
decoding through the key/value cache, giving the tokens a decode without cache gives with the same hooks."""

from __future__ import annotations

import pytest
import torch

from tests.hooks.families import FAMILIES, B, T, body, inputs, tiny
from tformer import hooks as tfh
from tformer.hooks import HookError, hook_names, points, run_with_cache, run_with_hooks
from tformer.layers import Tapped

EXACT = 1e-12  # float64 rounding of one attention layer's products in another order (O(1) values)


def all_taps_off(model) -> bool:
    return all(m.taps is None for m in model.modules() if isinstance(m, Tapped))


@pytest.mark.parametrize("family", FAMILIES)
def test_with_no_hook_attached_the_forward_is_bit_for_bit_the_same(family):
    model, args = tiny(family, torch.float32), inputs(family)
    before = model(*args)
    with tfh.hooks(model, [(lambda name: True, lambda x, hook: None)]):  # every point, on-demand ones too
        hooked = model(*args)
    assert all_taps_off(model)
    assert torch.equal(model(*args), before)
    assert (hooked - before).abs().max() < 1e-4  # the hooked path's formulas (norms, pattern): float32 rounding
    run_with_cache(model, *args, names=lambda name: True)
    assert all_taps_off(model)
    assert torch.equal(model(*args), before)


def test_hooks_come_off_when_a_hook_raises():
    model, args = tiny("llama", torch.float32), inputs("llama")
    before = model(*args)

    def fail(x, hook):
        raise RuntimeError(f"stop at {hook.name}")

    with pytest.raises(RuntimeError, match="blocks.1.attn.hook_pattern"):
        run_with_cache(model, *args, fwd_hooks=[("blocks.1.attn.hook_pattern", fail)])
    assert all_taps_off(model)
    with (
        pytest.raises(RuntimeError, match="blocks.0.hook_resid_mid"),
        tfh.hooks(model, [("blocks.0.hook_resid_mid", fail)]),
    ):
        model(*args)
    assert all_taps_off(model)
    assert torch.equal(model(*args), before)


def test_remove_all_and_handles_take_off_only_their_own_hooks():
    model, args = tiny("gpt2"), inputs("gpt2")
    seen: list[str] = []
    first = tfh.attach(model, [("blocks.0.hook_resid_pre", lambda x, hook: seen.append("first"))])
    second = tfh.attach(model, [("blocks.0.hook_resid_pre", lambda x, hook: seen.append("second"))])
    model(*args)
    first.remove()
    model(*args)
    assert seen == ["first", "second", "second"]
    assert model.taps is not None  # the second handle still holds a hook
    second.remove()
    assert all_taps_off(model)
    tfh.attach(model, [(lambda name: name.endswith("hook_z"), lambda x, hook: None)])
    tfh.remove_all(model)
    assert all_taps_off(model)


def test_a_hooks_value_is_the_one_the_forward_uses():
    """A hand-made pattern at ``hook_pattern`` gives ``z = pattern @ v`` (each query head over its key/value head,
    4 over 2), and the output changes with it."""
    model, args = tiny("llama"), inputs("llama")
    g = torch.Generator().manual_seed(1)
    made = torch.rand(B, 4, T, T, generator=g, dtype=torch.float64).tril()  # causal, then rows summing to 1
    made = made / made.sum(-1, keepdim=True)
    names = ["blocks.1.attn.hook_v", "blocks.1.attn.hook_z"]
    out, cache = run_with_cache(
        model, *args, names=names, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda x, h: made)]
    )
    v = cache["blocks.1.attn.hook_v"].transpose(1, 2).repeat_interleave(2, dim=1)  # (B, Hkv, T, D) -> (B, H, T, D)
    expected = (made @ v).transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)
    assert (cache["blocks.1.attn.hook_z"] - expected).abs().max() < EXACT
    assert (out - model(*args)).abs().max() > 1e-2


def test_a_hook_returning_the_wrong_shape_names_the_point_and_both_shapes():
    model, args = tiny("llama"), inputs("llama")
    with pytest.raises(HookError, match=r"blocks\.0\.hook_resid_pre.*\(2, 4, 32\).*\(2, 5, 32\)"):
        run_with_hooks(model, *args, hooks=[("blocks.0.hook_resid_pre", lambda x, hook: x[:, :-1])])
    with pytest.raises(HookError, match=r"blocks\.1\.attn\.hook_k.*\(2, 5, 4, 8\).*\(2, 5, 2, 8\)"):
        run_with_hooks(model, *args, hooks=[("blocks.1.attn.hook_k", lambda x, hook: x.repeat(1, 1, 2, 1))])
    assert all_taps_off(model)


def test_an_unknown_name_lists_close_ones_and_a_layer_out_of_range_names_the_depth():
    model, args = tiny("gpt2"), inputs("gpt2")
    with pytest.raises(KeyError, match="blocks.0.attn.hook_pattern"):
        run_with_hooks(model, *args, hooks=[("blocks.0.attn.hook_patern", lambda x, hook: None)])
    with pytest.raises(KeyError, match=r"layer 7 is out of range.*2 blocks"):
        run_with_cache(model, *args, names=["blocks.7.hook_resid_pre"])
    _, cache = run_with_cache(model, *args, names=["blocks.0.hook_resid_pre"])
    with pytest.raises(KeyError, match="blocks.0.hook_resid_pre"):  # what the cache holds
        cache["blocks.1.hook_resid_pre"]
    assert all_taps_off(model)


@pytest.mark.parametrize("family", ["gpt2", "post_ln", "bert"])
def test_stop_at_layer_returns_the_residual_stream_entering_that_block(family):
    model, args = tiny(family), inputs(family)
    _, cache = run_with_cache(model, *args, names=lambda n: "resid" in n)  # no norm hooked: the plain kernels
    for layer in range(2):
        assert torch.equal(run_with_hooks(model, *args, stop_at_layer=layer), cache["resid_pre", layer])
    last = (
        "blocks.1.hook_resid_post" if body(model).stack.blocks[0].norm_first else "blocks.1.hook_normalized_resid_post"
    )
    out, partial = run_with_cache(model, *args, stop_at_layer=2, names=[last, "blocks.1.hook_mlp_out"])
    assert torch.equal(out, cache[last]) and torch.equal(partial[last], out)  # the stream leaving the last block
    for bad in (3, -1):
        with pytest.raises(ValueError, match=rf"stop_at_layer={bad}.*2 blocks"):
            run_with_hooks(model, *args, stop_at_layer=bad)
    assert all_taps_off(model)


def test_the_cache_holds_what_was_asked_and_only_its_own_bytes():
    """Names, a predicate or TransformerLens's short form; q, k, v (views of one product) each owning only its
    own storage, so ``nbytes`` is what the names imply."""
    model, args = tiny("llama", torch.float32), inputs("llama")
    names = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.0.attn.hook_v", "blocks.1.attn.hook_pattern"]
    _, cache = run_with_cache(model, *args, names=names)
    assert list(cache) == names
    assert torch.equal(cache["pattern", 1], cache["blocks.1.attn.hook_pattern"])
    assert cache.nbytes() == 4 * (B * T * 4 * 8 + 2 * B * T * 2 * 8 + B * 4 * T * T)  # float32: 4 bytes a value
    _, some = run_with_cache(model, *args, names_filter=lambda n: n.endswith("hook_scale"))
    assert list(some) == [n for n in hook_names(model) if n.endswith("hook_scale")]
    assert all(not v.requires_grad for v in some.values())


def test_hooked_model_is_the_same_model_in_transformerlens_method_style():
    model, args = tiny("gpt2"), inputs("gpt2")
    hooked = tfh.HookedModel(model)
    out, cache = hooked.run_with_cache(*args, names=["blocks.1.hook_resid_post"])
    assert torch.equal(out, model(*args)) and hooked.hook_names == hook_names(model)
    _, direct = run_with_cache(model, *args, names=["blocks.1.hook_resid_post"])
    assert torch.equal(cache["resid_post", 1], direct["resid_post", 1])
    assert hooked.model is model and set(points(hooked)) == set(points(model))


# --------------------------------------------------------------------------------------------------
# Generation with hooks
# --------------------------------------------------------------------------------------------------
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]  # two lengths: the batch is left-padded


def steer(scale: float):
    direction = torch.randn(32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def add(x, hook):
        return x + scale * direction.to(x.dtype)

    return [("blocks.0.hook_resid_post", add)]


@pytest.mark.parametrize(("family", "scale"), [("gpt2", 10.0), ("llama", 4.0), ("post_ln", 4.0)])
def test_steering_while_decoding_with_the_cache_equals_decoding_without_it(family, scale):
    """(The scales: large enough to change these random models' text, which with tied embeddings mostly repeats
    the last token.)"""
    model = tiny(family)
    plain = tfh.generate(model, PROMPTS, max_new_tokens=8, greedy=True)
    cached = tfh.generate(model, PROMPTS, hooks=steer(scale), max_new_tokens=8, greedy=True)
    uncached = tfh.generate(model, PROMPTS, hooks=steer(scale), max_new_tokens=8, greedy=True, use_cache=False)
    assert cached == uncached
    assert cached != plain  # the steering changes the text, so the agreement is about the hooked steps
    assert all_taps_off(model)


def no_first_key(pattern, hook):
    """Layer 0 attends to everything but the first column (each row renormalized; a row left empty stays 0)."""
    pattern = pattern.clone()
    pattern[..., 0] = 0.0
    return pattern / pattern.sum(-1, keepdim=True).clamp_min(1e-30)


def test_a_pattern_edited_while_decoding_with_the_cache_equals_decoding_without_it():
    """The pattern hook sees ``(B, H, 1, past + 1)`` at each cached step (the padded row's mask included) and the
    whole ``(B, H, T, T)`` without cache: the same edit gives the same tokens (grouped-query heads, RoPE)."""
    model = tiny("llama")
    edit = [("blocks.0.attn.hook_pattern", no_first_key)]
    plain = tfh.generate(model, PROMPTS, max_new_tokens=8, greedy=True)
    cached = tfh.generate(model, PROMPTS, hooks=edit, max_new_tokens=8, greedy=True)
    assert cached == tfh.generate(model, PROMPTS, hooks=edit, max_new_tokens=8, greedy=True, use_cache=False)
    assert cached != plain
    assert all_taps_off(model)


def test_no_hook_picked_leaves_the_model_unhooked_and_decoding_on_its_fast_path(recwarn):
    """A filter that picks no point, or ``generate`` without hooks, attaches nothing: ``static_cache`` is honoured
    without a warning."""
    model = tiny("llama")
    with tfh.hooks(model, [(lambda name: False, lambda x, hook: None)]):
        assert all_taps_off(model)
    tfh.generate(model, PROMPTS, max_new_tokens=3, greedy=True, static_cache=True)
    assert not [w for w in recwarn if "hooks attached" in str(w.message)]


def test_hooks_fire_at_every_decoding_step_on_the_new_positions():
    """The prompt's forward once, then one call per fed token (the last new token is kept, not fed), each seeing
    the new position only; with ``static_cache`` asked, a warning, and the same calls."""
    model = tiny("llama")
    calls: list[tuple[int, ...]] = []
    count = [("blocks.1.attn.hook_q", lambda x, hook: calls.append(tuple(x.shape)))]
    first = tfh.generate(model, PROMPTS, hooks=count, max_new_tokens=6, greedy=True)
    assert calls == [(2, 5, 4, 8)] + [(2, 1, 4, 8)] * 5
    calls.clear()
    with pytest.warns(UserWarning, match="hooks attached"):
        static = tfh.generate(model, PROMPTS, hooks=count, max_new_tokens=6, greedy=True, static_cache=True)
    assert calls == [(2, 5, 4, 8)] + [(2, 1, 4, 8)] * 5 and static == first
    assert all_taps_off(model)
