"""Interventions mean what they say: zero-ablating a head is the model with that head's columns of ``W^O`` zeroed,
mean-ablating it the same with the mean's contribution moved into the output bias (grouped-query heads too);
patching an activation with its own clean value changes nothing, and patching the one position where clean and
corrupted differ restores the clean metric; a perfect hand-made induction pattern scores 1. Then patching SmolLM2
with itself at a few points."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.hooks.families import LMS, STACKS, T, body, ids, inputs, tiny
from tformer.circuits import (
    ablate_heads,
    head_means,
    induction_scores,
    logit_diff,
    patch_heads,
    patch_residual,
    repeated_tokens,
    restored,
)
from tformer.hooks import hooks, run_with_cache, run_with_hooks

EXACT = 1e-12  # float64 rounding of the same sums with one term zeroed or moved (O(1) values)
D = 8  # head_dim of the tiny models


def without_head(model, layer: int, head: int, mean: torch.Tensor | None = None):
    """A copy of ``model`` with head ``(layer, head)``'s columns of ``W^O`` zeroed; with ``mean (D,)``, their
    product with it added to the output bias (a constant ``z`` contributes ``W^O_h z`` at every position)."""
    other = copy.deepcopy(model)
    out_proj = body(other).stack.blocks[layer].self_attn.out_proj
    columns = slice(head * D, (head + 1) * D)
    with torch.no_grad():
        if mean is not None:
            out_proj.bias += out_proj.weight[:, columns] @ mean
        out_proj.weight[:, columns] = 0.0
    return other


@pytest.mark.parametrize("family", STACKS)
def test_zero_ablating_a_head_is_zeroing_its_columns_of_the_output_projection(family):
    model, args = tiny(family), inputs(family)
    with torch.no_grad():
        clean = model(*args)
    for layer, head in [(0, 1), (1, 3)]:  # grouped-query: heads 1 and 3 share key/value heads with 0 and 2
        ablated = run_with_hooks(model, *args, hooks=ablate_heads(model, [(layer, head)]))
        with torch.no_grad():
            by_weights = without_head(model, layer, head)(*args)
        assert (ablated - by_weights).abs().max() < EXACT
        assert (ablated - clean).abs().max() > 1e-3  # and the head did something


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_mean_ablating_a_head_is_moving_its_mean_output_into_the_bias(family):
    model, args = tiny(family), inputs(family)
    if family == "llama":  # no biases: give the out projection one to receive the mean (zero: the same model)
        for block in model.decoder.stack.blocks:
            block.self_attn.out_proj.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.float64))
    reference = inputs(family, seed=5)
    means = head_means(model, *reference)
    _, cache = run_with_cache(model, *reference, names=["blocks.1.attn.hook_z"])
    by_hand = cache["blocks.1.attn.hook_z"][:, :, 2].mean(dim=(0, 1))  # (B, T, H, D) -> head 2: (D,)
    assert (means[1][2] - by_hand).abs().max() < EXACT
    ablated = run_with_hooks(model, *args, hooks=ablate_heads(model, [(1, 2)], kind="mean", means=means))
    with torch.no_grad():
        expected = without_head(model, 1, 2, mean=by_hand)(*args)
    assert (ablated - expected).abs().max() < EXACT


def test_ablation_rejects_heads_out_of_range_and_unknown_kinds():
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"2 layers of 4 heads"):
        ablate_heads(model, [(2, 0)])
    with pytest.raises(ValueError, match="means=head_means"):
        ablate_heads(model, [(0, 0)], kind="mean")
    with pytest.raises(ValueError, match="'zero' or 'mean'"):
        ablate_heads(model, [(0, 0)], kind="resample")


@pytest.mark.parametrize("family", LMS)
def test_patching_with_the_clean_value_itself_changes_nothing(family):
    model, clean = tiny(family), ids()
    metric = logit_diff(3, 7)
    with torch.no_grad():
        expected = metric(model(clean))
    residual = patch_residual(model, clean, clean, metric)
    assert residual.shape == (2, T)
    assert (residual - expected).abs().max() < EXACT
    for point, count in [("z", 4), ("v", model.cfg.kv_heads), ("pattern", 4)]:  # v: key/value heads (2 in GQA)
        heads = patch_heads(model, clean, clean, metric, point=point)
        assert heads.shape == (2, count)
        assert (heads - expected).abs().max() < EXACT, point


@pytest.mark.parametrize("family", LMS)
def test_patching_the_one_corrupted_position_restores_the_clean_metric(family):
    """Clean and corrupted differ in their first token only. Entering block 0 the clean first position brings
    everything back (a causal model's other positions read it through attention only); any other position leaves
    the corrupted run as it was."""
    model, clean = tiny(family), ids()
    corrupted = clean.clone()
    corrupted[:, 0] = (clean[:, 0] + 1) % 41
    metric = logit_diff(3, 7)
    with torch.no_grad():
        clean_value, corrupted_value = metric(model(clean)), metric(model(corrupted))
    assert abs(clean_value - corrupted_value) > 1e-3
    patched = patch_residual(model, clean, corrupted, metric)
    assert abs(patched[0, 0] - clean_value) < EXACT
    assert (patched[0, 1:] - corrupted_value).abs().max() < EXACT
    share = restored(patched, float(clean_value), float(corrupted_value))
    assert abs(share[0, 0] - 1.0) < 1e-9  # EXACT over a difference of order 1e-3 and more


def test_patching_rejects_clean_and_corrupted_of_different_shapes():
    model = tiny("gpt2")
    with pytest.raises(ValueError, match="same shape"):
        patch_residual(model, ids(length=5), ids(length=6), logit_diff(3, 7))


def test_a_perfect_induction_pattern_scores_one():
    """Layer 1's pattern replaced by the induction pattern (query ``t`` of the repeat attends only to the token after
    the earlier occurrence of its own): score 1 for every head of that layer, less for layer 0's real pattern."""
    model = tiny("llama")
    length, prefix = 6, 1
    tokens = repeated_tokens(41, length, batch=2, seed=0, prefix=[0])
    assert tokens.shape == (2, prefix + 2 * length) and torch.equal(tokens[:, 1:7], tokens[:, 7:])
    total = prefix + 2 * length
    induction = torch.zeros(total, total, dtype=torch.float64)
    induction[torch.arange(total), 0] = 1.0  # outside the repeat: all on the first token
    for t in range(prefix + length, total):
        induction[t] = 0.0
        induction[t, t - length + 1] = 1.0

    def perfect(pattern, hook):
        return induction.expand_as(pattern)

    with hooks(model, [("blocks.1.attn.hook_pattern", perfect)]):
        scores = induction_scores(model, tokens, length, prefix=prefix)
    assert scores.shape == (2, 4)
    assert torch.equal(scores[1], torch.ones(4, dtype=scores.dtype))
    assert scores[0].max() < 0.9


# --------------------------------------------------------------------------------------------------
# The real model
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_patched_with_itself_is_unchanged(smollm):
    model, tokenizer = smollm.model, smollm.tokenizer
    clean = torch.tensor([tokenizer.encode("The capital of France is")])
    paris, london = tokenizer.encode(" Paris")[0], tokenizer.encode(" London")[0]
    metric = logit_diff(paris, london)
    with torch.no_grad():
        expected = metric(model(clean))
    assert expected > 0  # the model prefers Paris: the metric measures something
    names = ["blocks.3.hook_resid_pre", "blocks.20.hook_resid_mid", "blocks.12.attn.hook_z", "blocks.29.attn.hook_v"]
    _, cache = run_with_cache(model, clean, names=names)
    for name, position in zip(names, [2, -1, 1, -1], strict=True):

        def put(x, hook, position=position):
            x = x.clone()
            x[:, position] = cache[hook.name][:, position]
            return x

        with torch.no_grad():  # as the reference: the kernels may round otherwise when autograd records
            assert metric(run_with_hooks(model, clean, hooks=[(name, put)])) == expected, name
