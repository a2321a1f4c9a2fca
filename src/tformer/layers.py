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
from tformer.functional import attention_scores, masked_softmax
from tformer.positions import RotaryEmbedding


# --------------------------------------------------------------------------------------------------
# Hook points
# --------------------------------------------------------------------------------------------------
class Tapped:
    """A module with hook points: named places in its forward where :mod:`tformer.hooks` may read or replace an
    activation. ``taps`` is ``None`` unless hooks are attached, and then every point is ``x`` itself: the forward is
    the same function, bit for bit. Attached, ``taps(name, x)`` runs the hooks of point ``name`` and returns what
    they leave; ``taps.wants(*names)`` says whether any of those points has a hook (for values computed only then)."""

    taps = None


def tap(module: Tapped, name: str, x: Tensor) -> Tensor:
    """Hook point ``name`` of ``module``: ``x``, or what the attached hooks made of it (:class:`Tapped`)."""
    taps = module.taps
    return x if taps is None else taps(name, x)


def wants(module: Tapped, *names: str) -> bool:
    """Whether a hook is attached to any of ``module``'s points ``names``."""
    return module.taps is not None and module.taps.wants(*names)


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

    def select(self, index: Tensor) -> KVCache:
        """A new cache holding copies of rows ``index``; this one is unchanged (several continuations of one prefix)."""
        out = KVCache()
        if self.k is not None:
            out.k, out.v = self.k.index_select(0, index), self.v.index_select(0, index)
        out.length = self.length
        return out


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

    def select(self, index: Tensor) -> LayerCache:
        """A new cache holding copies of rows ``index``; this one is unchanged."""
        out = LayerCache(self.self_kv.select(index))
        if self.cross_kv is not None:
            out.cross_kv = (self.cross_kv[0].index_select(0, index), self.cross_kv[1].index_select(0, index))
        return out


# --------------------------------------------------------------------------------------------------
# Attention and feed-forward
# --------------------------------------------------------------------------------------------------
class MultiHeadAttention(Tapped, nn.Module):
    """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O``, ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``.

    Each of ``W^Q, W^K, W^V, W^O`` is ``d_model x d_model`` (``h`` heads of ``d_k = d_model/h``), so the
    layer holds ``4 d_model^2`` weights (``+ 4 d_model`` biases) for every head count ``h``. The three
    input projections are stored as one ``(3C, C)`` matrix (as ``nn.MultiheadAttention``): self-attention
    does one matmul; cross-attention projects queries from ``x`` and keys/values from ``context``.
    With ``num_kv_heads < num_heads`` (grouped-query attention) ``W^K, W^V`` shrink to ``C x Hkv*D``.
    ``qkv_bias`` (default: ``bias``) gives the input projections biases of their own (Qwen2: only they have some).

    Hook points (:class:`Tapped`): ``hook_q, hook_k, hook_v`` (new tokens, before RoPE), ``hook_rot_q, hook_rot_k``,
    ``hook_attn_scores, hook_pattern`` (computed only when hooked), ``hook_z`` (heads' outputs), ``hook_result``
    (each head's term of the output, computed only when hooked).
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
            q, k, v = tap(self, "hook_q", q), tap(self, "hook_k", k), tap(self, "hook_v", v)
            if self.rotary is not None:
                if rope is None:  # called on its own: look the angles up here
                    past = cache.self_kv.length if cache is not None else 0
                    if positions is None:
                        positions = torch.arange(past, past + T, device=x.device)
                    self.rotary.reserve(past + T)
                    rope = self.rotary(positions)
                q, k = self.rotary.rotate(q, rope), self.rotary.rotate(k, rope)
                q, k = tap(self, "hook_rot_q", q), tap(self, "hook_rot_k", k)
            if cache is not None:
                k, v = cache.self_kv.update(k, v)  # (B, Hkv, past + T, D)
        else:  # cross-attention: queries from x, keys and values from the context
            weight, bias = self.in_proj.weight, self.in_proj.bias
            q = tap(self, "hook_q", self._heads(F.linear(x, weight[:C], None if bias is None else bias[:C]), H))
            if cache is not None and cache.cross_kv is not None:
                k, v = cache.cross_kv
            else:
                kv = F.linear(context, weight[C:], None if bias is None else bias[C:])  # (B, S, 2*Hkv*D)
                k, v = self._heads(kv, 2 * Hkv).split_with_sizes([Hkv, Hkv], dim=1)  # (B, Hkv, S, D) x2
                k, v = tap(self, "hook_k", k), tap(self, "hook_v", v)
                if cache is not None:
                    cache.cross_kv = (k, v)
        dropout_p = self.dropout if self.training else 0.0
        if wants(self, "hook_attn_scores", "hook_pattern"):
            out = self._attend_shown(q, k, v, attn_mask, is_causal, dropout_p)
        else:  # q, k, v are right by construction: skip the argument checks of scaled_dot_product_attention
            out = attention.attend(q, k, v, attn_mask, is_causal, None, dropout_p, attention.resolve(self.backend))
        z = tap(self, "hook_z", out.transpose(1, 2).reshape(B, T, H, D))  # (B, H, T, D) -> (B, T, H, D), one copy
        if wants(self, "hook_result"):
            return self._sum_heads(z)
        return self.out_proj(z.reshape(B, T, C))  # concat(heads) W^O

    def _attend_shown(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout_p: float
    ) -> Tensor:
        """Attention with its scores ``(B, H, T, S)`` (scaled, forbidden entries ``-inf``) and pattern at hook points:
        the pattern the hooks leave is the one that weighs the values. Key/value head ``j // (H/Hkv)`` serves query
        head ``j`` (grouped-query attention)."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
        scores = tap(self, "hook_attn_scores", attention_scores(q, k, attn_mask, is_causal))
        pattern = tap(self, "hook_pattern", masked_softmax(scores))
        if dropout_p > 0.0:
            pattern = F.dropout(pattern, p=dropout_p)
        return pattern @ v  # (B, H, T, S) @ (B, H, S, D)

    def _sum_heads(self, z: Tensor) -> Tensor:
        """``out = sum_h z_h W^O_h + b`` with each head's term ``(B, T, H, C)`` at hook point ``hook_result``."""
        B, T, H, D = z.shape
        w_o = self.out_proj.weight.view(self.d_model, H, D)  # (C, H*D) -> (C, H, D): head h's columns of W^O
        result = tap(self, "hook_result", torch.einsum("bthd,chd->bthc", z, w_o.to(z.dtype)))
        out = result.sum(dim=2)  # (B, T, C)
        return out if self.out_proj.bias is None else out + self.out_proj.bias


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # x Phi(x), Phi the standard normal CDF
    "gelu_tanh": partial(F.gelu, approximate="tanh"),  # GPT-2: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    "silu": F.silu,  # x sigmoid(x) (Llama's, gated: SwiGLU)
}


class FeedForward(Tapped, nn.Module):
    """Position-wise ``FFN(x) = W_2 act(W_1 x + b_1) + b_2`` with ``W_1: C -> d_ff``, ``W_2: d_ff -> C``.

    Hook points (:class:`Tapped`): ``hook_pre`` (``W_1 x + b_1``; gated: ``W_g x``), ``hook_pre_linear`` (gated:
    ``W_1 x``), ``hook_post`` (what ``W_2`` multiplies), each ``(B, T, d_ff)``."""

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
        h = tap(self, "hook_post", self.activation(tap(self, "hook_pre", self.up(x))))
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
        h = self.activation(tap(self, "hook_pre", gate)) * tap(self, "hook_pre_linear", up)
        h = tap(self, "hook_post", h)
        return self.down(self.dropout(h) if self.training else h)


class LayerNorm(Tapped, nn.LayerNorm):
    """``(x - mean) / scale * g + b`` with ``scale = sqrt(var + eps)``: PyTorch's kernel, or, with hooks attached,
    the formula with hook points ``hook_scale (B, T, 1)`` and ``hook_normalized`` (``(x - mean) / scale``, before
    ``g`` and ``b``: TransformerLens's convention)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.taps is None:
            return super().forward(x)
        var, mean = torch.var_mean(x, dim=-1, unbiased=False, keepdim=True)  # one pass over x for both
        scale = tap(self, "hook_scale", (var + self.eps).sqrt())
        out = tap(self, "hook_normalized", (x - mean) / scale)
        out = out if self.weight is None else out * self.weight
        return out if self.bias is None else out + self.bias


class RMSNorm(Tapped, nn.RMSNorm):
    """``x / scale * g`` with ``scale = sqrt(mean(x^2) + eps)``: PyTorch's kernel, or, with hooks attached, the
    formula with hook points ``hook_scale (B, T, 1)`` and ``hook_normalized`` (``x / scale``, before ``g``:
    TransformerLens's convention)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.taps is None:
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # nn.RMSNorm's default
        scale = tap(self, "hook_scale", (x.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt())
        out = tap(self, "hook_normalized", x / scale)
        return out if self.weight is None else out * self.weight


def make_norm(cfg: TransformerConfig) -> LayerNorm | RMSNorm:
    """The norm of every sublayer: ``LayerNorm`` (``(x - mean) / std * g + b``) or ``RMSNorm`` (``x / rms(x) * g``,
    Zhang & Sennrich 2019), with ``cfg.layer_norm_eps`` inside the root."""
    if cfg.norm == "rms":
        return RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)


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
class TransformerBlock(Tapped, nn.Module):
    """Self-attention, optional cross-attention, feed-forward: each a residual sublayer.

    Pre-LN (``norm_first=True``):  ``x <- x + F(LN(x))``  -- an identity path from output to input.
    Post-LN (``norm_first=False``): ``x <- LN(x + F(x))``  -- the 2017 paper; every gradient crosses every LN.

    Hook points (:class:`Tapped`), each ``(B, T, C)``: ``hook_resid_pre``; ``hook_attn_out``; ``hook_resid_mid``
    (the sum after attention, before Post-LN's norm); ``hook_cross_attn_out`` and ``hook_resid_mid_cross``;
    ``hook_mlp_in`` (the stream entering the feed-forward sublayer, before a Pre-LN norm; replacing it leaves the
    residual stream as it is); ``hook_mlp_out``; ``hook_resid_post`` (Pre-LN: the block's output; Post-LN: the sum
    before the last norm, whose output is ``hook_normalized_resid_post``).
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

        def mlp(h: Tensor) -> Tensor:
            return tap(self, "hook_mlp_out", self._drop(self.ff(h)))

        x = tap(self, "hook_resid_pre", x)
        if self.norm_first:  # Pre-LN: x <- x + F(LN(x))
            a = tap(self, "hook_attn_out", self._drop(attend(self.self_attn_norm(x))))
            x = tap(self, "hook_resid_mid", x + a)
            if self.cross_attn is not None:
                c = tap(self, "hook_cross_attn_out", self._drop(cross(self.cross_attn_norm(x))))
                x = tap(self, "hook_resid_mid_cross", x + c)
            return tap(self, "hook_resid_post", x + mlp(self.ff_norm(tap(self, "hook_mlp_in", x))))
        a = tap(self, "hook_attn_out", self._drop(attend(x)))  # Post-LN: x <- LN(x + F(x))
        x = self.self_attn_norm(tap(self, "hook_resid_mid", x + a))
        if self.cross_attn is not None:
            c = tap(self, "hook_cross_attn_out", self._drop(cross(x)))
            x = self.cross_attn_norm(tap(self, "hook_resid_mid_cross", x + c))
        m = mlp(tap(self, "hook_mlp_in", x))
        return tap(self, "hook_normalized_resid_post", self.ff_norm(tap(self, "hook_resid_post", x + m)))


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
