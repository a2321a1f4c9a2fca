"""The config's orthogonal choices that real model families need, each checked on its own against the formula it
implements (float64, so the comparisons are exact up to rounding): RMSNorm, the gated feed-forward, q/k/v-only biases,
the half layout of the sinusoid (RoPE's: tests/core/test_functional.py), token types, the embedding norm and scale,
the logits bias, and old configs' ``rope_interleaved``. End to end, ``tests/interop`` compares them with
``transformers``."""

from __future__ import annotations

import math

import pytest
import torch

from tformer import DecoderLM, EncoderDecoder, TransformerConfig
from tformer.functional import sinusoidal_positional_encoding
from tformer.generation.stopping import Stopper
from tformer.layers import GatedFeedForward, MultiHeadAttention, make_norm
from tformer.models import Encoder

EXACT = 1e-12  # float64 rounding of a few dozen operations on O(1) numbers


def x64(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_rms_norm_divides_by_the_root_mean_square_without_centring():
    norm = make_norm(TransformerConfig.tiny(norm="rms", layer_norm_eps=1e-6)).double()
    with torch.no_grad():
        norm.weight.copy_(1 + x64(norm.weight.shape[0], seed=1))
    x = x64(3, 5, norm.weight.shape[0]) + 2.0  # a non-zero mean: LayerNorm would remove it, RMSNorm does not
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert (norm(x) - expected).abs().max() < EXACT
    assert not hasattr(norm, "bias") or norm.bias is None


def test_gated_feed_forward_is_w2_of_act_gate_times_up():
    ffn = GatedFeedForward(8, 12, bias=False, activation="silu").double()
    gate_w, up_w = ffn.up.weight[:12], ffn.up.weight[12:]  # stored as one matrix, rows gate | up
    x = x64(2, 3, 8)
    gate, up = x @ gate_w.T, x @ up_w.T
    expected = (gate * torch.sigmoid(gate) * up) @ ffn.down.weight.T  # SiLU(g) = g sigmoid(g)
    assert (ffn(x) - expected).abs().max() < EXACT
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 8 * 12  # three matrices (Llama's gate, up, down)


@pytest.mark.parametrize(("bias", "qkv_bias", "expected"), [(True, None, 4), (False, None, 0), (False, True, 3)])
def test_qkv_bias_gives_only_the_input_projections_biases(bias, qkv_bias, expected):
    d = 16
    mha = MultiHeadAttention(d, 4, bias=bias, qkv_bias=qkv_bias)
    weights = sum(p.numel() for name, p in mha.named_parameters() if name.endswith("weight"))
    biases = sum(p.numel() for name, p in mha.named_parameters() if name.endswith("bias"))
    assert weights == 4 * d * d  # the source's 4 d_model^2, whatever the biases
    assert biases == expected * d  # Qwen2: q, k and v only


def test_the_half_sinusoid_layout_is_the_same_pairs_in_two_halves():
    half = sinusoidal_positional_encoding(50, 16, dtype=torch.float64, layout="half")
    inter = sinusoidal_positional_encoding(50, 16, dtype=torch.float64)
    assert torch.equal(half[:, :8], inter[:, 0::2]) and torch.equal(half[:, 8:], inter[:, 1::2])
    pos, omega = (
        torch.arange(50, dtype=torch.float64)[:, None],
        10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16),
    )
    assert (half[:, :8] - torch.sin(pos * omega)).abs().max() < EXACT


def test_token_types_add_a_segment_embedding_and_default_to_segment_zero():
    cfg = TransformerConfig.tiny(type_vocab_size=2, embed_norm=True, norm_first=False, dropout=0.0)
    model = Encoder(cfg).double().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    zeros, ones = torch.zeros_like(ids), torch.ones_like(ids)
    assert torch.equal(model(ids), model(ids, token_type_ids=zeros))
    assert (model(ids) - model(ids, token_type_ids=ones)).abs().max() > 1e-3
    embed = model.embed
    positions = torch.arange(6)
    raw = embed.tokens(ids) * embed.scale + embed.positions(positions) + embed.token_types(ones)
    assert (embed(ids, positions, ones) - embed.norm(raw)).abs().max() < EXACT  # the norm comes after the sum
    with pytest.raises(ValueError, match="type_vocab_size=0"):
        Encoder(TransformerConfig.tiny())(ids, token_type_ids=zeros)


@pytest.mark.parametrize(
    ("model_class", "setting", "scaled"),
    [
        (DecoderLM, None, False),
        (EncoderDecoder, None, True),
        (DecoderLM, True, True),
        (EncoderDecoder, False, False),
    ],
)
def test_embed_scale_defaults_to_the_models_own_convention(model_class, setting, scaled):
    model = model_class(TransformerConfig.tiny(embed_scale=setting))
    scales = {m.scale for m in model.modules() if hasattr(m, "scale") and hasattr(m, "tokens")}
    assert scales == {math.sqrt(model.cfg.d_model) if scaled else 1.0}


def test_the_logits_bias_is_added_to_every_position_and_saved():
    cfg = TransformerConfig.tiny(logits_bias=True)
    model = DecoderLM(cfg).double().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    before = model(ids)
    model.logits_bias.copy_(x64(cfg.vocab_size))
    assert (model(ids) - before - model.logits_bias).abs().max() < EXACT
    assert "logits_bias" in model.state_dict()
    assert DecoderLM(TransformerConfig.tiny()).logits_bias is None


@pytest.mark.parametrize(("old", "layout"), [(True, "interleaved"), (False, "half")])
def test_old_configs_rope_interleaved_still_load(old, layout):
    data = TransformerConfig.tiny().to_dict()
    del data["pair_layout"]
    data["rope_interleaved"] = old
    assert TransformerConfig.from_dict(data).pair_layout == layout


def test_a_list_of_eos_ids_ends_a_row_at_any_of_them(random_lm, random_prompts):
    from tformer import generate

    model = random_lm()
    free = generate(model, random_prompts([3, 5]), max_new_tokens=12, greedy=True)
    first, second = free[0][2], free[1][4]
    ended = generate(model, random_prompts([3, 5]), max_new_tokens=12, greedy=True, eos_id=[first, second])
    cut = [row[: next(i for i, t in enumerate(row) if t in (first, second))] for row in free]
    assert ended == cut
    assert Stopper(None, [first, second]).eos_ids == {first, second}
