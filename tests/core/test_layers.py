"""Layers against PyTorch's own modules, and the parameter count of multi-head attention."""

import re

import pytest
import torch
from torch import nn

from tformer import DecoderLM, MultiHeadAttention, TransformerBlock, TransformerConfig
from tformer.layers import FeedForward

TOL = dict(rtol=1e-10, atol=1e-10)  # float64 on both sides: differences are summation order only


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16])
def test_mha_has_four_d_model_squared_weights_for_every_head_count(heads):
    d = 64
    assert sum(p.numel() for p in MultiHeadAttention(d, heads, bias=False).parameters()) == 4 * d * d
    assert sum(p.numel() for p in MultiHeadAttention(d, heads, bias=True).parameters()) == 4 * d * d + 4 * d


def _copy_mha(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        ours.in_proj.weight.copy_(theirs.in_proj_weight)
        ours.in_proj.bias.copy_(theirs.in_proj_bias)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_mha_equals_torch_multihead_attention(backend):
    torch.manual_seed(0)
    d, h = 24, 4
    theirs = nn.MultiheadAttention(d, h, batch_first=True, dtype=torch.float64)
    ours = MultiHeadAttention(d, h, backend=backend).double()
    _copy_mha(ours, theirs)
    x, ctx = torch.randn(3, 7, d, dtype=torch.float64), torch.randn(3, 5, d, dtype=torch.float64)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[0, 3:] = False
    keep[2, 1:] = False
    # self-attention with a padding mask (theirs: True = ignore; ours: True = may attend)
    self_keep = torch.ones(3, 7, dtype=torch.bool)
    self_keep[1, 4:] = False
    expected, _ = theirs(x, x, x, key_padding_mask=~self_keep, need_weights=False)
    torch.testing.assert_close(ours(x, attn_mask=self_keep[:, None, None, :]), expected, **TOL)
    # cross-attention: queries from x, keys/values from ctx
    expected, _ = theirs(x, ctx, ctx, key_padding_mask=~keep, need_weights=False)
    torch.testing.assert_close(ours(x, ctx, attn_mask=keep[:, None, None, :]), expected, **TOL)
    # causal self-attention
    causal = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)
    expected, _ = theirs(x, x, x, attn_mask=causal, need_weights=False)
    torch.testing.assert_close(ours(x, is_causal=True), expected, **TOL)


def _copy_block(ours: TransformerBlock, theirs: nn.Module, decoder: bool) -> None:
    _copy_mha(ours.self_attn, theirs.self_attn)
    if decoder:
        _copy_mha(ours.cross_attn, theirs.multihead_attn)
    pairs = [
        (ours.ff.up, theirs.linear1),
        (ours.ff.down, theirs.linear2),
        (ours.self_attn_norm, theirs.norm1),
    ]
    pairs += (
        [(ours.cross_attn_norm, theirs.norm2), (ours.ff_norm, theirs.norm3)]
        if decoder
        else [(ours.ff_norm, theirs.norm2)]
    )
    with torch.no_grad():
        for a, b in pairs:
            a.weight.copy_(b.weight)
            a.bias.copy_(b.bias)


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_block_equals_torch_encoder_layer(norm_first):
    torch.manual_seed(1)
    d, h, ff = 32, 4, 64
    cfg = TransformerConfig.tiny(d_model=d, num_heads=h, d_ff=ff, norm_first=norm_first)
    theirs = nn.TransformerEncoderLayer(d, h, ff, dropout=0.0, batch_first=True, norm_first=norm_first).double()
    ours = TransformerBlock(cfg, cross_attention=False).double()
    _copy_block(ours, theirs, decoder=False)
    x = torch.randn(2, 9, d, dtype=torch.float64)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 6:] = False
    theirs.train()  # the train-mode path: eval mode may take PyTorch's fused "fast path" that zeroes pads
    expected = theirs(x, src_key_padding_mask=~keep)
    torch.testing.assert_close(ours(x, self_mask=keep[:, None, None, :]), expected, **TOL)


@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_block_equals_torch_decoder_layer(norm_first):
    torch.manual_seed(2)
    d, h, ff = 32, 4, 64
    cfg = TransformerConfig.tiny(d_model=d, num_heads=h, d_ff=ff, norm_first=norm_first)
    theirs = nn.TransformerDecoderLayer(d, h, ff, dropout=0.0, batch_first=True, norm_first=norm_first).double()
    ours = TransformerBlock(cfg, cross_attention=True).double()
    _copy_block(ours, theirs, decoder=True)
    tgt, memory = torch.randn(2, 6, d, dtype=torch.float64), torch.randn(2, 8, d, dtype=torch.float64)
    mem_keep = torch.ones(2, 8, dtype=torch.bool)
    mem_keep[0, 5:] = False
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    expected = theirs(tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=~mem_keep)
    got = ours(tgt, is_causal=True, memory=memory, memory_mask=mem_keep[:, None, None, :])
    torch.testing.assert_close(got, expected, **TOL)


def _ffn_grad_norms(norm_first: bool, layers: int = 12) -> torch.Tensor:
    """Per-layer gradient norm of the FFN output matrix W_2 of a language model at initialization.

    Xavier-uniform matrices as in the 2017 paper and Xiong et al. (2020), whose Fig. 3 this reproduces.
    """
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=64,
        d_model=64,
        num_heads=4,
        d_ff=256,
        num_layers=layers,
        norm_first=norm_first,
        max_seq_len=64,
    )
    model = DecoderLM(cfg).double()
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.xavier_uniform_(p)
    ids = torch.randint(0, 64, (8, 32))
    logits = model(ids[:, :-1])
    nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    return torch.stack([b.ff.down.weight.grad.norm() for b in model.decoder.stack.blocks])


def test_post_ln_gradients_grow_toward_the_output_pre_ln_do_not():
    """Source Q3(b) / Xiong et al. 2020: at initialization Post-LN's gradients are largest at the top layers
    (every gradient crosses every LN; the reason it needs warmup), while Pre-LN's identity path keeps them
    from growing with depth. Measured here for 12 layers: Post-LN top/bottom ~1.7, Pre-LN ~0.43, and
    Post-LN's top-layer gradient ~6.6x Pre-LN's; the asserted margins are about half of those.
    (A larger max/min *spread* for Post-LN does not hold under this init: Pre-LN's spread is as large,
    but it falls with depth instead of growing; see the layernorm experiment.)"""
    post, pre = _ffn_grad_norms(False), _ffn_grad_norms(True)
    assert post[-1] / post[0] > 1.3
    assert pre[-1] / pre[0] < 0.8
    assert post[-1] > 3 * pre[-1]


def test_grouped_query_mha_equals_repeated_key_value_heads():
    """H=6 query heads share Hkv=2 key/value heads: query head j reads kv head j // 3 (repeat_interleave)."""
    torch.manual_seed(3)
    B, T, d, H, Hkv = 2, 5, 24, 6, 2
    D = d // H
    mha = MultiHeadAttention(d, H, num_kv_heads=Hkv).double()
    assert mha.in_proj.weight.shape == (d + 2 * Hkv * D, d)
    x = torch.randn(B, T, d, dtype=torch.float64)
    q, k, v = nn.functional.linear(x, mha.in_proj.weight, mha.in_proj.bias).split([d, Hkv * D, Hkv * D], dim=-1)
    q = q.view(B, T, H, D).transpose(1, 2)
    k, v = (t.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    weights = (q @ k.transpose(-1, -2) / D**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
    expected = mha.out_proj((weights @ v).transpose(1, 2).reshape(B, T, d))
    torch.testing.assert_close(mha(x, is_causal=True), expected, **TOL)


def test_gelu_tanh_is_gpt2_activation_and_close_to_exact_gelu():
    torch.manual_seed(4)
    exact = FeedForward(16, 64, activation="gelu").double()
    approx = FeedForward(16, 64, activation="gelu_tanh").double()
    approx.load_state_dict(exact.state_dict())
    x = 3 * torch.randn(50, 16, dtype=torch.float64)
    h = approx.up(x)
    gpt2 = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))  # GPT-2's gelu
    torch.testing.assert_close(approx(x), approx.down(gpt2), **TOL)
    # |GELU - its tanh approximation| < 5e-4 everywhere (max 4.73e-4, at |h| = 2.70), so the layer outputs
    # differ by at most that times the l1 norm of a row of W_2
    bound = 5e-4 * approx.down.weight.abs().sum(dim=1).max()
    difference = (approx(x) - exact(x)).abs().max()
    assert 0 < difference < bound
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        FeedForward(16, 64, activation="swish")


def test_layers_refuse_sizes_and_inputs_that_do_not_fit():
    from tformer.positions import LearnedPositions, RotaryEmbedding

    for args, kwargs, message in [
        ((30, 0), {}, "num_heads must be at least 1"),
        ((0, 1), {}, "d_model and num_heads must be at least 1"),
        ((32, 4), dict(num_kv_heads=0), "num_kv_heads=0 must divide"),
    ]:
        with pytest.raises(ValueError, match=message):
            MultiHeadAttention(*args, **kwargs)
    with pytest.raises(ValueError, match="even head dimension of at least 2; got 0"):
        RotaryEmbedding(0)
    with pytest.raises(ValueError, match="max_len >= 1"):
        LearnedPositions(0, 8)
    mha = MultiHeadAttention(32, 4)
    for shape in [(5, 32), (1, 5, 16)]:
        with pytest.raises(ValueError, match=rf"x must be \(batch, time, d_model=32\); got {re.escape(str(shape))}"):
            mha(torch.randn(shape))


def test_cache_select_copies_rows_and_leaves_the_prefix_cache_unchanged():
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=64)
    model = DecoderLM(cfg).double().eval()
    prefix, cache = torch.randint(50, (3, 5)), model.new_cache()
    model(prefix, cache=cache)
    before = [(layer.self_kv.k[..., :5, :].clone(), layer.self_kv.v[..., :5, :].clone()) for layer in cache]
    index = torch.tensor([2, 0, 2])
    rows = [layer.select(index) for layer in cache]
    nxt = torch.randint(50, (3, 2))
    got = model(nxt, cache=rows)  # each selected row continues its own prefix
    want = model(torch.cat([prefix[index], nxt], dim=1))[:, -2:]
    torch.testing.assert_close(got, want, **TOL)
    for layer, (k, v) in zip(cache, before, strict=True):
        assert layer.self_kv.length == 5  # the storage past the length is uninitialized: compared up to it
        assert torch.equal(layer.self_kv.k[..., :5, :], k) and torch.equal(layer.self_kv.v[..., :5, :], v)
