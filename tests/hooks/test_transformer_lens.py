"""tformer's hook points against TransformerLens itself (4.3, its ``TransformerBridge`` in compatibility mode, no
weight processing) on the same tiny random Hugging Face models, built offline (``tl_models``): the same activations
at the shared names.

What is compared: the HF model is saved and loaded by tformer's interop (so tformer computes with its own modules),
and the bridge wraps a copy of the same model. For GPT-2 (learned positions, LayerNorm, GELU) and Llama (RoPE,
RMSNorm, SwiGLU, grouped-query heads) every one of tformer's points exists in TransformerLens with the same meaning.
For BERT, TransformerLens 4.3 gives five names other meanings than its own HookedEncoder had (``tl_models``'
docstring): the points compared are the ones whose meaning agrees.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

pytest.importorskip("transformer_lens", reason="TransformerLens is a pinned test dependency (pip install -e .[dev])")

import tformer  # noqa: E402
from tests.hooks.tl_models import random_tokens, tl_bridge  # noqa: E402
from tformer import hooks  # noqa: E402

pytestmark = pytest.mark.slow  # TransformerLens's import and first bridge take ~7 s

# BERT: TransformerLens 4.3 calls other values hook_attn_scores (the softmaxed pattern), hook_attn_out (after ln1),
# hook_resid_mid and hook_resid_post (Post-LN sums in other places), and has no embedding points of these names
BERT_OTHER_MEANING = ("hook_attn_scores", "hook_attn_out", "hook_resid_mid", "hook_resid_post")
# float32 through two 64-wide blocks in two implementations: differences of a few ulps of values of size ~1-10
ATOL, RTOL = 2e-5, 1e-5


def _pair(family: str):
    reference, bridge = tl_bridge(family, use_attn_result=family != "bert", use_hook_mlp_in=family != "bert")
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        ours = tformer.load_pretrained(folder, dtype=torch.float32).model
    return ours, bridge


def _compared(family: str, names: list[str]) -> list[str]:
    if family != "bert":
        return names
    return [
        n
        for n in names
        if n.startswith("blocks.")
        and not n.endswith(BERT_OTHER_MEANING)
        and not n.endswith(("hook_result", "hook_normalized_resid_post"))
    ]


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_the_same_activations_as_transformer_lens_at_the_shared_names(family):
    ours, bridge = _pair(family)
    ids = random_tokens(batch=2, pos=12)
    names = _compared(family, hooks.hook_names(ours))
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(ids)
    _, cache = hooks.run_with_cache(ours, ids, names=names)
    assert len(names) >= {"gpt2": 43, "llama": 48, "bert": 28}[family]  # every point of the model, or BERT's shared
    for name in names:
        a, b = cache[name], theirs[name]
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name  # masked scores are -inf in both
        finite = torch.isfinite(a)
        torch.testing.assert_close(a[finite], b[finite], atol=ATOL, rtol=RTOL, msg=name)


def test_a_patch_gives_the_same_logits_as_in_transformer_lens():
    # an intervention, not only a reading: zero one grouped-query key head of layer 1 in both libraries
    ours, bridge = _pair("llama")
    ids = random_tokens(batch=2, pos=12)

    def zero_kv_head(k, hook):  # (B, T, Hkv, D): a key head shared by two query heads
        k = k.clone()
        k[:, :, 1] = 0.0
        return k

    with torch.no_grad():
        theirs = bridge.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_k", zero_kv_head)])
        mine = hooks.run_with_hooks(ours, ids, hooks=[("blocks.1.attn.hook_k", zero_kv_head)])
        plain = ours(ids)
    assert (mine - plain).abs().max() > 1e-2  # the patch changes the output
    torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=RTOL)
