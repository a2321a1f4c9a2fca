"""Layers: multi-head attention, feed-forward, norms, and the one residual block (positions: :mod:`tformer.positions`).

Shapes: B, T, S, C, H, Hkv, D (the package legend, :mod:`tformer`). Masks follow the library convention of
:mod:`tformer.functional`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer import attention
from tformer.config import TransformerConfig
from tformer.positions import RotaryEmbedding


# --------------------------------------------------------------------------------------------------
# Key/value cache for incremental decoding
# --------------------------------------------------------------------------------------------------
class KVCache:
    """Keys and values of the positions seen so far by one self-attention layer.

    Storage ``(B, Hkv, capacity, D)`` grows by doubling, so appending one token costs O(1) amortized copies.
    Any object with ``update``, ``reorder`` and ``length`` serves :class:`LayerCache` as well (a cache allocated once
    for compiled decoding: :class:`tformer.generation.static.StaticKVCache`).
    """

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k, v (B, Hkv, T, D)``; return all keys and values so far ``(B, Hkv, length, D)``."""
        new_len = self.length + k.shape[-2]
        if self.k is None or new_len > self.k.shape[-2]:
            capacity = max(new_len, 2 * (self.k.shape[-2] if self.k is not None else 0), 16)
            grown_k = k.new_empty(*k.shape[:-2], capacity, k.shape[-1])
            grown_v = v.new_empty(*v.shape[:-2], capacity, v.shape[-1])
            if self.k is not None:
                grown_k[..., : self.length, :] = self.k[..., : self.length, :]
                grown_v[..., : self.length, :] = self.v[..., : self.length, :]
            self.k, self.v = grown_k, grown_v
        self.k.narrow(-2, self.length, k.shape[-2]).copy_(k)  # narrow + copy_: cheaper calls than slice assignment
        self.v.narrow(-2, self.length, v.shape[-2]).copy_(v)
        self.length = new_len
        return self.k.narrow(-2, 0, new_len), self.v.narrow(-2, 0, new_len)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search re-ranking)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


@dataclass
class LayerCache:
    """What one block remembers between decoding steps: its self-attention keys/values and, in an
    encoder-decoder, the cross-attention keys/values of the encoder output (computed once)."""

    self_kv: KVCache = field(default_factory=KVCache)
    cross_kv: tuple[Tensor, Tensor] | None = None

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` of the self-attention cache and the cross-attention keys and values."""
        self.self_kv.reorder(index)
        if self.cross_kv is not None:
            self.cross_kv = (self.cross_kv[0].index_select(0, index), self.cross_kv[1].index_select(0, index))


# --------------------------------------------------------------------------------------------------
# Attention and feed-forward
# --------------------------------------------------------------------------------------------------
class MultiHeadAttention(nn.Module):
    """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O``, ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``.

    Each of ``W^Q, W^K, W^V, W^O`` is ``d_model x d_model`` (``h`` heads of ``d_k = d_model/h``), so the
    layer holds ``4 d_model^2`` weights (``+ 4 d_model`` biases) for every head count ``h``. The three
    input projections are stored as one ``(3C, C)`` matrix (as ``nn.MultiheadAttention``): self-attention
    does one matmul; cross-attention projects queries from ``x`` and keys/values from ``context``.
    With ``num_kv_heads < num_heads`` (grouped-query attention) ``W^K, W^V`` shrink to ``C x Hkv*D``.
    ``qkv_bias`` (default: ``bias``) gives the input projections biases of their own (Qwen2: only they have some).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        dropout: float = 0.0,
        *,
        num_kv_heads: int | None = None,
        rotary: RotaryEmbedding | None = None,
        backend: str = "auto",
        qkv_bias: bool | None = None,
    ) -> None:
        super().__init__()
        if d_model < 1 or num_heads < 1:
            raise ValueError(f"d_model and num_heads must be at least 1; got d_model={d_model}, num_heads={num_heads}")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={num_heads}")
        self.head_dim = d_model // num_heads
        attention.resolve(backend)  # an unknown name fails here, not at the first forward
        self.d_model, self.dropout, self.backend, self.rotary = d_model, dropout, backend, rotary
        kv_dim = self.num_kv_heads * self.head_dim
        in_bias = bias if qkv_bias is None else qkv_bias
        self.in_proj = nn.Linear(d_model, d_model + 2 * kv_dim, bias=in_bias)  # rows: W^Q | W^K | W^V
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)  # W^O

    def _heads(self, t: Tensor, heads: int) -> Tensor:
        B, T, _ = t.shape
        return t.view(B, T, heads, self.head_dim).transpose(1, 2)  # (B, T, H*D) -> (B, H, T, D)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        *,
        positions: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """``x (B, T, C)`` attends to itself (``context=None``) or to ``context (B, S, C)``.

        ``attn_mask`` broadcastable to ``(B, H, T, S)``; RoPE (self-attention only) turns queries and keys by
        ``rope``, the angles :class:`RotaryEmbedding` looked up for this batch, or else by those of ``positions``
        (``(T,)`` or ``(B, T)``; default: ``past .. past + T - 1``); ``cache`` holds past keys/values for
        incremental decoding.
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (batch, time, d_model={self.d_model}); got {tuple(x.shape)}")
        B, T, C = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if context is None:  # self-attention: one matmul gives the H query heads, then Hkv key and Hkv value heads
            qkv = self.in_proj(x).view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # (B, H + 2 Hkv, T, D)
            q, k, v = qkv.split_with_sizes([H, Hkv, Hkv], dim=1)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
            if self.rotary is not None:
                if rope is None:  # called on its own: look the angles up here
                    past = cache.self_kv.length if cache is not None else 0
                    if positions is None:
                        positions = torch.arange(past, past + T, device=x.device)
                    self.rotary.reserve(past + T)
                    rope = self.rotary(positions)
                q, k = self.rotary.rotate(q, rope), self.rotary.rotate(k, rope)
            if cache is not None:
                k, v = cache.self_kv.update(k, v)  # (B, Hkv, past + T, D)
        else:  # cross-attention: queries from x, keys and values from the context
            weight, bias = self.in_proj.weight, self.in_proj.bias
            q = self._heads(F.linear(x, weight[:C], None if bias is None else bias[:C]), H)
            if cache is not None and cache.cross_kv is not None:
                k, v = cache.cross_kv
            else:
                kv = F.linear(context, weight[C:], None if bias is None else bias[C:])  # (B, S, 2*Hkv*D)
                k, v = self._heads(kv, 2 * Hkv).split_with_sizes([Hkv, Hkv], dim=1)  # (B, Hkv, S, D) x2
                if cache is not None:
                    cache.cross_kv = (k, v)
        dropout_p = self.dropout if self.training else 0.0
        # q, k, v are right by construction: skip the argument checks of scaled_dot_product_attention
        out = attention.attend(q, k, v, attn_mask, is_causal, None, dropout_p, attention.resolve(self.backend))
        out = out.transpose(1, 2).reshape(B, T, C)  # (B, H, T, D) -> (B, T, C)
        return self.out_proj(out)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # x Phi(x), Phi the standard normal CDF
    "gelu_tanh": partial(F.gelu, approximate="tanh"),  # GPT-2: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    "silu": F.silu,  # x sigmoid(x) (Llama's, gated: SwiGLU)
}


class FeedForward(nn.Module):
    """Position-wise ``FFN(x) = W_2 act(W_1 x + b_1) + b_2`` with ``W_1: C -> d_ff``, ``W_2: d_ff -> C``."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        """``x (B, T, C)`` -> ``W_2 act(W_1 x)``, ``(B, T, C)``: each position on its own."""
        h = self.activation(self.up(x))
        return self.down(self.dropout(h) if self.training else h)  # eval: skip the call (decoding is per-call bound)


class GatedFeedForward(FeedForward):
    """``FFN(x) = W_2 (act(W_g x) * (W_1 x))`` (Shazeer 2020, "GLU Variants"; with SiLU: SwiGLU, Llama's).

    ``W_g`` and ``W_1`` are stored as one ``(2 d_ff, C)`` matrix ``up`` (rows: gate | up), so one matmul gives both.
    """

    def __init__(self, d_model: int, d_ff: int, bias: bool = True, dropout: float = 0.0, activation: str = "silu"):
        super().__init__(d_model, d_ff, bias, dropout, activation)
        self.up = nn.Linear(d_model, 2 * d_ff, bias=bias)  # rows: W_g | W_1

    def forward(self, x: Tensor) -> Tensor:
        """``x (B, T, C)`` -> ``W_2 (act(W_g x) * (W_1 x))``, ``(B, T, C)``."""
        gate, up = self.up(x).chunk(2, dim=-1)  # (B, T, 2 d_ff) -> 2 x (B, T, d_ff)
        h = self.activation(gate) * up
        return self.down(self.dropout(h) if self.training else h)


def make_norm(cfg: TransformerConfig) -> nn.Module:
    """The norm of every sublayer: ``LayerNorm`` (``(x - mean) / std * g + b``) or ``RMSNorm`` (``x / rms(x) * g``,
    Zhang & Sennrich 2019), with ``cfg.layer_norm_eps`` inside the root."""
    if cfg.norm == "rms":
        return nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)


def make_feed_forward(cfg: TransformerConfig) -> FeedForward:
    kind = GatedFeedForward if cfg.ffn == "gated" else FeedForward
    return kind(cfg.d_model, cfg.d_ff, cfg.bias, cfg.dropout, cfg.activation)


class Pooler(nn.Module):
    """BERT's pooler: ``tanh(W h_0 + b)`` of an encoder's first (``[CLS]``) token, ``(B, T, C) -> (B, C)``."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


# --------------------------------------------------------------------------------------------------
# The residual block and the stack
# --------------------------------------------------------------------------------------------------
class TransformerBlock(nn.Module):
    """Self-attention, optional cross-attention, feed-forward: each a residual sublayer.

    Pre-LN (``norm_first=True``):  ``x <- x + F(LN(x))``  -- an identity path from output to input.
    Post-LN (``norm_first=False``): ``x <- LN(x + F(x))``  -- the 2017 paper; every gradient crosses every LN.
    """

    def __init__(self, cfg: TransformerConfig, *, cross_attention: bool, rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.norm_first = cfg.norm_first

        def attention(rope: RotaryEmbedding | None) -> MultiHeadAttention:
            return MultiHeadAttention(
                cfg.d_model,
                cfg.num_heads,
                cfg.bias,
                cfg.dropout,
                num_kv_heads=cfg.num_kv_heads,
                rotary=rope,
                backend=cfg.attn_backend,
                qkv_bias=cfg.qkv_bias,
            )

        self.self_attn, self.self_attn_norm = attention(rotary), make_norm(cfg)
        self.cross_attn = attention(None) if cross_attention else None
        self.cross_attn_norm = make_norm(cfg) if cross_attention else None
        self.ff, self.ff_norm = make_feed_forward(cfg), make_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def _drop(self, h: Tensor) -> Tensor:
        return self.dropout(h) if self.training else h  # eval: skip the call (decoding is per-call bound)

    def forward(
        self,
        x: Tensor,
        self_mask: Tensor | None = None,
        is_causal: bool = False,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: LayerCache | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``x (B, T, C)``; ``memory (B, S, C)`` for cross-attention; masks broadcastable to ``(B, H, T, *)``;
        ``rope``: the RoPE angles of this batch (:class:`RotaryEmbedding`), shared by every block."""
        if self.cross_attn is not None and memory is None and (cache is None or cache.cross_kv is None):
            raise ValueError("this block has cross-attention: pass the encoder output as memory")

        def attend(h: Tensor) -> Tensor:
            return self.self_attn(h, None, self_mask, is_causal, rope=rope, cache=cache)

        def cross(h: Tensor) -> Tensor:
            return self.cross_attn(h, memory, memory_mask, cache=cache)

        if self.norm_first:  # Pre-LN: x <- x + F(LN(x))
            x = x + self._drop(attend(self.self_attn_norm(x)))
            if self.cross_attn is not None:
                x = x + self._drop(cross(self.cross_attn_norm(x)))
            return x + self._drop(self.ff(self.ff_norm(x)))
        x = self.self_attn_norm(x + self._drop(attend(x)))  # Post-LN: x <- LN(x + F(x))
        if self.cross_attn is not None:
            x = self.cross_attn_norm(x + self._drop(cross(x)))
        return self.ff_norm(x + self._drop(self.ff(x)))


class BlockStack(nn.Module):
    """``num_layers`` blocks; with Pre-LN a final LayerNorm normalizes the residual stream."""

    def __init__(
        self,
        cfg: TransformerConfig,
        num_layers: int,
        *,
        cross_attention: bool,
        rotary: RotaryEmbedding | None,
    ):
        super().__init__()
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg, cross_attention=cross_attention, rotary=rotary) for _ in range(num_layers)
        )
        self.final_norm = make_norm(cfg) if cfg.norm_first else nn.Identity()

    def forward(self, x: Tensor, *, caches: list[LayerCache] | None = None, **kwargs) -> Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if caches is None else caches[i], **kwargs)
        return self.final_norm(x)


def init_weights(module: nn.Module, num_layers: int, embed_std: float) -> None:
    """GPT-2 style: linear weights N(0, 0.02); the projections that write into the residual stream
    (``out_proj``, ``ff.down``) N(0, 0.02/sqrt(2 L)) so the stream's variance does not grow with depth;
    biases 0; embeddings N(0, embed_std)."""
    residual_std = 0.02 / math.sqrt(2 * num_layers)
    for name, p in module.named_parameters():
        if name.endswith("bias") or "norm" in name:
            continue
        if name.endswith(("out_proj.weight", "ff.down.weight")):
            nn.init.normal_(p, std=residual_std)
        elif "embed" in name or "positions.table" in name:
            nn.init.normal_(p, std=embed_std)
        elif p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
    for name, p in module.named_parameters():
        if name.endswith("bias") and "norm" not in name:
            nn.init.zeros_(p)
