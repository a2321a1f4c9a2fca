"""The hook points say what they hold: on a tiny model of each family every name of the table fires exactly once in
a forward, with its documented shape, and no point fires that the table does not name; the cached attention patterns
are the softmax of the layer's own (rotated) queries and keys under the layer's mask, each grouped-query head reading
its own key/value head; and on tiny ``transformers`` models loaded through tformer's interop the patterns and the
residual stream equal ``output_attentions`` and ``output_hidden_states``."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.hooks.families import FAMILIES, SIZES, B, S, T, inputs, tiny
from tests.interop.hf_models import tiny_hf
from tformer import EncoderDecoder
from tformer.functional import attention_weights
from tformer.hooks import hook_names, points, run_with_cache, run_with_hooks
from tformer.interop import load_pretrained
from tformer.layers import GatedFeedForward, LayerNorm, Tapped
from tformer.models import Encoder, self_attention_mask

EXACT = 1e-12  # float64 rounding of a softmax of a few dot products of length 8, in another matmul order
HF_ROPE = 1e-6  # transformers computes RoPE's cos/sin in float32 even in a float64 model: angles off by ~1e-7
PADDED = [0, 2]  # padding tokens per row of the masked batches (row 1 loses two)


def symbols(model, name: str, args: tuple) -> dict[str, int]:
    """What each symbol of a point's shape stands for at point ``name`` on input ``args``."""
    cfg = model.cfg
    own = args[1].shape[1] if isinstance(model, EncoderDecoder) and not name.startswith("encoder") else args[0].shape[1]
    keys = args[0].shape[1] if "cross_attn" in name else own  # cross-attention's keys: the source
    return dict(
        B=args[0].shape[0], T=own, S=keys, C=cfg.d_model, H=cfg.num_heads, Hkv=cfg.kv_heads,
        D=cfg.head_dim, F=cfg.d_ff, V=cfg.vocab_size, **{"1": 1},
    )  # fmt: skip


def documented(model, name: str, args: tuple) -> tuple[int, ...]:
    """The shape the table documents for point ``name``, its symbols resolved."""
    sizes = symbols(model, name, args)
    return tuple(sizes[s.strip()] for s in points(model)[name].shape.strip("()").split(","))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_point_fires_once_with_its_documented_shape(family):
    model, args = tiny(family, torch.float32), inputs(family)
    names = hook_names(model)
    fired = Counter()
    run_with_hooks(model, *args, hooks=[(lambda name: True, lambda x, hook: fired.update([hook.name]))])
    assert fired == Counter(names)  # each once, none twice, none missing
    results = [n for n in names if n.endswith("hook_result")]
    _, cache = run_with_cache(model, *args)
    _, asked = run_with_cache(model, *args, names=results)  # computed only when asked for
    assert list(cache) == [n for n in names if n not in results]  # every other point, in firing order
    assert list(asked) == results
    for name, value in {**cache, **asked}.items():
        assert tuple(value.shape) == documented(model, name, args), name


class Recorder:
    """Stands in for the hooks of one module: records every point its forward passes through, wants them all."""

    def __init__(self, module, log: list) -> None:
        self.module, self.log = module, log

    def wants(self, *names: str) -> bool:
        return True

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        self.log.append((id(self.module), name))
        return x


@pytest.mark.parametrize("family", FAMILIES)
def test_no_point_fires_that_the_table_does_not_name(family):
    """Every ``tap`` of every module, caught below the hooks API: the places the forward passes are the table's."""
    model, args = tiny(family, torch.float32), inputs(family)
    log: list = []
    tapped = [m for m in model.modules() if isinstance(m, Tapped)]
    try:
        for module in tapped:
            module.taps = Recorder(module, log)
        model(*args)
    finally:
        for module in tapped:
            module.taps = None
    table = Counter((id(p.module), p.local) for p in points(model).values())
    assert Counter(log) == table


def test_the_layouts_of_the_head_points():
    """q and z ``(B, T, H, D)``, k and v ``(B, S, Hkv, D)`` (TransformerLens's order, grouped-query heads), and
    a cross-attention's keys over the source."""
    model, args = tiny("llama", torch.float32), inputs("llama")
    _, cache = run_with_cache(model, *args, names=lambda n: n.startswith("blocks.0.attn."))
    H, Hkv, D = 4, 2, 8
    for local in ("q", "rot_q", "z"):
        assert cache[f"blocks.0.attn.hook_{local}"].shape == (B, T, H, D)
    for local in ("k", "rot_k", "v"):
        assert cache[f"blocks.0.attn.hook_{local}"].shape == (B, T, Hkv, D)
    seq2seq, args = tiny("marian_pre", torch.float32), inputs("marian_pre")
    _, cache = run_with_cache(seq2seq, *args, names=lambda n: n.startswith("decoder.1.cross_attn."))
    assert cache["decoder.1.cross_attn.hook_q"].shape == (B, T, H, D)
    assert cache["decoder.1.cross_attn.hook_k"].shape == (B, S, H, D)
    assert cache["decoder.1.cross_attn.hook_pattern"].shape == (B, H, T, S)


def padded_inputs(family: str) -> tuple[tuple, list[tuple[str, torch.Tensor | None, bool]]]:
    """A forward's arguments with padding, and ``(attention prefix, key mask (B, S) or None, causal)`` of each
    attention layer of the model."""
    cls, _ = FAMILIES[family]
    args = inputs(family)
    last = args[0].shape[1]
    mask = torch.ones(B, last, dtype=torch.bool)
    if cls is Encoder:  # right padding
        mask[1, last - PADDED[1] :] = False
        return (args[0], mask, args[2]), [(f"blocks.{i}.attn", mask, False) for i in range(2)]
    if cls is EncoderDecoder:
        tgt_mask = torch.ones(B, T, dtype=torch.bool)
        mask[1, last - PADDED[1] :] = False
        tgt_mask[1, T - 1 :] = False
        layers = [(f"encoder.{i}.attn", mask, False) for i in range(2)]
        layers += [(f"decoder.{i}.attn", tgt_mask, True) for i in range(2)]
        layers += [(f"decoder.{i}.cross_attn", mask, False) for i in range(2)]
        return (args[0], args[1], mask, tgt_mask), layers
    mask[1, : PADDED[1]] = False  # left padding, as generate pads prompts
    return (args[0], mask), [(f"blocks.{i}.attn", mask, True) for i in range(2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_patterns_are_the_softmax_of_the_layers_own_queries_and_keys(family):
    """``functional.attention_weights`` on the cached ``rot_q, rot_k`` (rotary) or ``q, k`` with the layer's mask
    (padding, causal): the pattern the forward used comes from the layer's real queries and keys."""
    model = tiny(family)
    args, layers = padded_inputs(family)
    _, cache = run_with_cache(model, *args)
    rotary = "hook_rot_q" in " ".join(cache)
    for prefix, key_mask, causal in layers:
        q_name, k_name = ("hook_rot_q", "hook_rot_k") if rotary and "cross" not in prefix else ("hook_q", "hook_k")
        q = cache[f"{prefix}.{q_name}"].transpose(1, 2)  # (B, T, H, D) -> (B, H, T, D)
        k = cache[f"{prefix}.{k_name}"].transpose(1, 2)  # (B, S, Hkv, D) -> (B, Hkv, S, D)
        if "cross" in prefix:
            layer_mask = key_mask[:, None, None, :]  # (B, 1, 1, S): the source's padding
        else:
            layer_mask, is_causal = self_attention_mask(key_mask, q.shape[2], 0, causal)
            assert not is_causal  # with padding the causal part is in the mask
        expected = attention_weights(q, k, layer_mask)
        pattern = cache[f"{prefix}.hook_pattern"]
        assert (pattern - expected).abs().max() < EXACT, prefix
        masked = pattern.masked_select(~layer_mask.expand_as(pattern))
        assert masked.numel() > 0 and torch.equal(masked, torch.zeros_like(masked))  # padding and future: weight 0


def test_each_grouped_query_head_reads_its_own_key_head():
    """Query head ``j`` of 4 reads key head ``j // 2`` of 2: its pattern is computed from that head alone, and
    from the other key head it would differ (so the mapping is what the comparison checks)."""
    model = tiny("llama")
    _, cache = run_with_cache(model, *inputs("llama"), names=lambda n: n.startswith("blocks.1.attn."))
    q = cache["blocks.1.attn.hook_rot_q"].transpose(1, 2)  # (B, H, T, D)
    k = cache["blocks.1.attn.hook_rot_k"].transpose(1, 2)  # (B, Hkv, T, D)
    pattern = cache["blocks.1.attn.hook_pattern"]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for j in range(4):
        for head in range(2):
            scores = q[:, j] @ k[:, head].transpose(-1, -2) / math.sqrt(8)  # (B, T, T)
            by_hand = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            error = (pattern[:, j] - by_hand).abs().max()
            assert error < EXACT if head == j // 2 else error > 1e-3, (j, head)


def hf_and_ours(case: str, tmp_path):
    """A tiny ``transformers`` model (eager attention, float64) and tformer's model of its saved files."""
    hf = tiny_hf(case, attn="eager").double()
    hf.save_pretrained(tmp_path)
    return hf, load_pretrained(tmp_path).model.double()


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_patterns_and_residuals_equal_transformers_outputs(case, tmp_path):
    """``output_attentions`` equal ``hook_pattern`` (Llama: 4 query heads over 2 key/value heads); the hidden
    states entering each layer equal ``hook_resid_pre``, and the last one, after the final norm, equals the final
    norm's output (``hook_normalized``, before the gain and bias, TransformerLens's convention, then those applied)."""
    hf, model = hf_and_ours(case, tmp_path)
    ids = torch.randint(1, 60, (B, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(input_ids=ids, output_attentions=True, output_hidden_states=True)
    _, cache = run_with_cache(model, ids)
    depth, tol = model.cfg.num_layers, HF_ROPE if case == "llama" else EXACT * 10  # residuals: O(10) values
    assert len(theirs.attentions) == depth and len(theirs.hidden_states) == depth + 1
    for i in range(depth):
        assert (cache["pattern", i] - theirs.attentions[i]).abs().max() < tol
        assert (cache["resid_pre", i] - theirs.hidden_states[i]).abs().max() < tol
    norm = model.decoder.stack.final_norm
    final = cache["ln_final.hook_normalized"] * norm.weight  # the point is before the gain (and bias)
    if getattr(norm, "bias", None) is not None:
        final = final + norm.bias
    assert (final - theirs.hidden_states[depth]).abs().max() < tol


def test_the_table_names_each_family_as_its_convention_says():
    """The prefixes of each model kind (the docs' table): an LM's ``hook_embed``/``blocks.i``/``ln_final``/
    ``hook_unembed``, an encoder's ``embed.``, an encoder-decoder's two stacks with the decoder's cross-attention and
    third norm."""
    lm, bert = hook_names(tiny("llama")), hook_names(tiny("bert"))
    pre, post = hook_names(tiny("marian_pre")), hook_names(tiny("marian_post"))
    assert lm[0] == "hook_embed" and lm[-3:] == ["ln_final.hook_scale", "ln_final.hook_normalized", "hook_unembed"]
    assert "hook_pos_embed" not in lm and "blocks.1.attn.hook_rot_k" in lm and "blocks.0.mlp.hook_pre_linear" in lm
    assert bert[:5] == [
        "embed.hook_embed",
        "embed.hook_pos_embed",
        "embed.hook_token_type_embed",
        "embed.ln.hook_scale",
        "embed.ln.hook_normalized",
    ]
    assert "ln_final.hook_scale" not in bert and "blocks.1.hook_normalized_resid_post" in bert  # Post-LN
    for names in (pre, post):
        assert names[0] == "encoder.embed.hook_embed" and names[-1] == "hook_unembed"
        assert {
            "decoder.1.cross_attn.hook_pattern",
            "decoder.1.hook_resid_mid_cross",
            "decoder.0.ln3.hook_scale",
        } < set(names)
    assert "encoder_final_ln.hook_scale" in pre and "decoder_final_ln.hook_normalized" in pre
    assert not any("final_ln" in n for n in post)
    assert SIZES["num_layers"] == 2 and not any(n.startswith(("encoder.2.", "decoder.2.")) for n in pre)


def norm_of(norm, x: torch.Tensor, cache, name: str) -> torch.Tensor:
    """``norm(x)`` recomputed from the formula, after checking the norm's points: ``hook_scale`` is the root of
    the mean square (of the centred ``x`` for LayerNorm, plus epsilon) and ``hook_normalized`` is ``x / scale``."""
    centred = x - x.mean(-1, keepdim=True) if isinstance(norm, LayerNorm) else x
    scale = (centred.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    assert (cache[name + "hook_scale"] - scale).abs().max() < EXACT * 10, name
    assert (cache[name + "hook_normalized"] - centred / scale).abs().max() < EXACT * 10, name
    out = centred / scale * norm.weight
    return out if getattr(norm, "bias", None) is None else out + norm.bias


def attention_of(attn, x: torch.Tensor, cache, p: str, causal: bool, context: torch.Tensor | None = None):
    """Check the points of attention ``attn`` (prefix ``p``) on input ``x`` against the formula; return its output."""
    H, Hkv, D, C = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.d_model
    w, b = attn.in_proj.weight, attn.in_proj.bias
    q = x @ w[:C].T + (0 if b is None else b[:C])  # (B, T, C)
    kv = (x if context is None else context) @ w[C:].T + (0 if b is None else b[C:])  # (B, S, 2 Hkv D)
    k, v = kv.split(Hkv * D, dim=-1)
    for local, value, heads in (("q", q, H), ("k", k, Hkv), ("v", v, Hkv)):
        assert (cache[f"{p}hook_{local}"] - value.view(*value.shape[:2], heads, D)).abs().max() < EXACT * 10, p
    q, k = cache.get(f"{p}hook_rot_q", cache[f"{p}hook_q"]), cache.get(f"{p}hook_rot_k", cache[f"{p}hook_k"])
    groups = H // Hkv
    scores = q.transpose(1, 2) @ k.transpose(1, 2).repeat_interleave(groups, 1).transpose(-1, -2) / math.sqrt(D)
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    cached = cache[f"{p}hook_attn_scores"]
    assert torch.equal(cached.isinf(), scores.isinf()), p  # -inf exactly where the mask forbids
    assert (cached - scores).nan_to_num(0.0).abs().max() < EXACT * 10, p
    assert (cache[f"{p}hook_pattern"] - scores.softmax(-1)).abs().max() < EXACT, p
    z = scores.softmax(-1) @ cache[f"{p}hook_v"].transpose(1, 2).repeat_interleave(groups, 1)  # (B, H, T, D)
    assert (cache[f"{p}hook_z"] - z.transpose(1, 2)).abs().max() < EXACT, p
    w_o = attn.out_proj.weight.view(C, H, D)
    result = torch.einsum("bhtd,chd->bthc", z, w_o)  # each head's term (B, T, H, C)
    assert (cache[f"{p}hook_result"] - result).abs().max() < EXACT * 10, p
    return result.sum(2) + (0 if attn.out_proj.bias is None else attn.out_proj.bias)


def mlp_of(ff, x: torch.Tensor, cache, p: str) -> torch.Tensor:
    """Check the feed-forward's points on input ``x`` against the formula; return its output."""
    up = x @ ff.up.weight.T + (0 if ff.up.bias is None else ff.up.bias)
    if isinstance(ff, GatedFeedForward):
        gate, linear = up.chunk(2, dim=-1)  # rows of W_up: W_g | W_1
        assert (cache[p + "mlp.hook_pre_linear"] - linear).abs().max() < EXACT * 10, p
        post = ff.activation(gate) * linear
    else:
        gate, post = up, ff.activation(up)
    assert (cache[p + "mlp.hook_pre"] - gate).abs().max() < EXACT * 10, p
    assert (cache[p + "mlp.hook_post"] - post).abs().max() < EXACT * 10, p
    return post @ ff.down.weight.T + (0 if ff.down.bias is None else ff.down.bias)


def embedding_of(embed, ids: torch.Tensor, types: torch.Tensor | None, cache, p: str) -> torch.Tensor:
    """Check the embedding points against ``E[ids] * scale + PE[t] (+ E_type[types])`` (then BERT's norm)."""
    x = embed.tokens.weight[ids] * embed.scale
    assert (cache[p + "hook_embed"] - x).abs().max() < EXACT, p
    if embed.positions is not None:
        pos = embed.positions(torch.arange(ids.shape[1]))  # (T, C)
        assert (cache[p + "hook_pos_embed"] - pos).abs().max() < EXACT, p
        x = x + pos
    if embed.token_types is not None:
        x = x + embed.token_types.weight[types]
        assert (cache[p + "hook_token_type_embed"] - embed.token_types.weight[types]).abs().max() < EXACT, p
    return x if embed.norm is None else norm_of(embed.norm, x, cache, p + "ln.")


def stacks_of(model, args: tuple) -> list[tuple]:
    """``(block prefix, embedding prefix, final norm prefix, stack, ids, token types, causal)`` of each stack."""
    if isinstance(model, EncoderDecoder):
        return [
            ("encoder.", "encoder.embed.", "encoder_final_ln.", model.encoder, args[0], None, False),
            ("decoder.", "decoder.embed.", "decoder_final_ln.", model.decoder, args[1], None, True),
        ]
    if isinstance(model, Encoder):
        return [("blocks.", "embed.", "ln_final.", model, args[0], args[2], False)]
    return [("blocks.", "", "ln_final.", model.decoder, args[0], None, True)]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_point_holds_what_the_math_says_where_the_math_says(family):
    """Every point recomputed from the formulas and the weights (TransformerLens 1317: hooks firing at other places
    than their names say): the embeddings, the norms' scales and outputs, q/k/v from the projections, scores and
    pattern, z, each head's result, the sublayer outputs, the residual sums (Pre-LN ``x + F(LN(x))``, Post-LN
    ``LN(x + F(x))``), each block's input the previous one's output, and the logits from the last."""
    model, args = tiny(family), inputs(family)
    _, cache = run_with_cache(model, *args, names=hook_names(model))
    memory = None
    for prefix, embed_prefix, final_prefix, stack, ids, types, causal in stacks_of(model, args):
        previous = embedding_of(stack.embed, ids, types, cache, embed_prefix)
        for i, block in enumerate(stack.stack.blocks):
            p = f"{prefix}{i}."
            x = cache[p + "hook_resid_pre"]
            assert (x - previous).abs().max() < EXACT * 10, p
            attn_in = norm_of(block.self_attn_norm, x, cache, p + "ln1.") if block.norm_first else x
            a = attention_of(block.self_attn, attn_in, cache, p + "attn.", causal)
            assert (cache[p + "hook_attn_out"] - a).abs().max() < EXACT * 10, p
            assert (cache[p + "hook_resid_mid"] - (x + a)).abs().max() < EXACT * 10, p
            h = x + a if block.norm_first else norm_of(block.self_attn_norm, x + a, cache, p + "ln1.")
            if block.cross_attn is not None:
                c_in = norm_of(block.cross_attn_norm, h, cache, p + "ln2.") if block.norm_first else h
                c = attention_of(block.cross_attn, c_in, cache, p + "cross_attn.", False, context=memory)
                assert (cache[p + "hook_cross_attn_out"] - c).abs().max() < EXACT * 10, p
                assert (cache[p + "hook_resid_mid_cross"] - (h + c)).abs().max() < EXACT * 10, p
                h = h + c if block.norm_first else norm_of(block.cross_attn_norm, h + c, cache, p + "ln2.")
            ff_norm = p + ("ln3." if block.cross_attn is not None else "ln2.")
            assert (cache[p + "hook_mlp_in"] - h).abs().max() < EXACT * 10, p  # the stream, before Pre-LN's norm
            m = mlp_of(block.ff, norm_of(block.ff_norm, h, cache, ff_norm) if block.norm_first else h, cache, p)
            assert (cache[p + "hook_mlp_out"] - m).abs().max() < EXACT * 10, p
            assert (cache[p + "hook_resid_post"] - (h + m)).abs().max() < EXACT * 10, p
            previous = h + m
            if not block.norm_first:
                previous = norm_of(block.ff_norm, previous, cache, ff_norm)
                assert (cache[p + "hook_normalized_resid_post"] - previous).abs().max() < EXACT * 10, p
        memory = norm_of(stack.stack.final_norm, previous, cache, final_prefix) if block.norm_first else previous
    if "hook_unembed" in cache:
        w_u = model.head.weight if model.head is not None else model.decoder.embed.tokens.weight
        assert (cache["hook_unembed"] - memory @ w_u.T).abs().max() < EXACT * 100  # logits: sums of 32 O(10) terms
