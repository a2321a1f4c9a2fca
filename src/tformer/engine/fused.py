"""A decode step of Llama-style blocks as one kernel call (``tformer::decode_blocks``, ``kernels/block.cpp``).

A step over a static cache (:mod:`tformer.generation.static`) reads every weight once and does little else, so its
speed is the weights' bytes over the memory bandwidth plus what runs between the products. :func:`step` hands the
whole stack of blocks to one C++ op: the same products and attention kernels, with the norms, RoPE, the cache write,
SwiGLU and the residual sums between them done in place, block after block, so no Python runs between the products
(BENCHMARKS.md, "Decoding SmolLM2-135M").

When (:func:`plan`): every block :func:`fits` (Pre-LN with RMSNorm, rotary self-attention on the ``auto``, ``sdpa``
or ``kernel`` backend, a gated SiLU feed-forward: Llama, Qwen2, Mistral, SmolLM2) and all have the same heads and RoPE
layout, in eval mode; one new token per row, at most :func:`tformer.engine.kernels.max_rows` rows of the activations'
dtype, or of int8 where every projection has int8 codes; bfloat16 or float32 on the CPU, with the weights in that
dtype or int8 (:func:`tformer.quantize`); no gradient asked for; the kernels built and on. The blocks are looked up
once a generation, so the model must not change during one except in place (as for a compiled step's replay). The op
rounds where the modules do (``block.cpp`` says where): in float32 the same function up to the order of float32
additions, in bfloat16 within a few roundings (the tests bound both). :func:`enabled` turns it off alone.

Shapes: B, C, S (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer import attention
from tformer.engine import kernels
from tformer.engine.quantization import Int8Linear
from tformer.layers import GatedFeedForward, TransformerBlock

_on = True  # the fused step's own switch (:func:`enabled`)
_BACKENDS = ("sdpa", "kernel")  # the attention the op computes: the default one, not a backend asked for by name


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Turn the fused step on or off inside a ``with`` block, the other kernels staying as they are (A/B
    measurements); compiled graphs guard on it."""
    global _on
    before, _on = _on, on
    try:
        yield
    finally:
        _on = before


def fits(block: TransformerBlock) -> bool:
    """Whether ``block``'s structure is the one ``decode_blocks`` computes: Pre-LN; RMSNorms with weights; rotary
    self-attention and no cross-attention, on the default attention (``auto``, ``sdpa`` or the engine's ``kernel``;
    another backend was asked for by name); a gated SiLU feed-forward; its four projections ``nn.Linear`` or
    :class:`Int8Linear`."""
    attn, ff = block.self_attn, block.ff
    if not block.norm_first or block.cross_attn is not None or block.training or attn.rotary is None:
        return False
    if attention.resolve(attn.backend).name not in _BACKENDS:
        return False
    for norm in (block.self_attn_norm, block.ff_norm):
        if not isinstance(norm, nn.RMSNorm) or norm.weight is None:
            return False
    if type(ff) is not GatedFeedForward or ff.activation is not F.silu:
        return False
    return all(isinstance(p, (nn.Linear, Int8Linear)) for p in (attn.in_proj, attn.out_proj, ff.up, ff.down))


class StackArguments(NamedTuple):
    """What ``decode_blocks`` takes of a stack of blocks, in flat lists: per block, the two RMSNorms' weights and eps,
    the four projections (q|k|v, out, gate|up, down) as weights or int8 codes, their scales (int8) and biases; and
    the attention's shape, which every block shares."""

    norms: list[Tensor]
    eps: list[float]
    weights: list[Tensor]
    scales: list[Tensor | None]
    biases: list[Tensor | None]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    interleaved: bool


def arguments(blocks: Sequence[TransformerBlock], dtype: torch.dtype) -> StackArguments:
    """The :class:`StackArguments` of ``blocks`` for activations of ``dtype`` (the caller checked :func:`fits` and
    that the blocks share their attention's shape, :func:`_alike`)."""
    norms, eps, weights, scales, biases = [], [], [], [], []
    for block in blocks:
        for norm in (block.self_attn_norm, block.ff_norm):
            norms.append(norm.weight)
            eps.append(torch.finfo(dtype).eps if norm.eps is None else norm.eps)  # nn.RMSNorm's default
        for p in _projections(block):
            quantized = isinstance(p, Int8Linear)
            weights.append(p.codes if quantized else p.weight)
            scales.append(p.scale if quantized else None)
            biases.append(p.bias)
    attn = blocks[0].self_attn
    return StackArguments(
        norms, eps, weights, scales, biases, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary.interleaved
    )


def _alike(blocks: Sequence[TransformerBlock]) -> bool:
    """Whether every block has the first one's heads, head size and RoPE pair layout (one shape for the op)."""

    def shape(block: TransformerBlock) -> tuple:
        attn = block.self_attn
        return attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary.interleaved

    return len({shape(block) for block in blocks}) == 1


# A generation's first static cache -> (dtype, its blocks' arguments or None): an eager step looks its blocks up once,
# not ~50 module attributes a block from Python. A model must not change during one generation except in place.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan(blocks: nn.ModuleList, x: Tensor, caches: list) -> StackArguments | None:
    """The blocks' arguments when :func:`step` runs this decode step of ``x (B, 1, C)`` into the static ``caches``
    of ``blocks`` (the module docstring's conditions), else ``None``. The blocks' structure is checked once a
    generation (eager; a compiled graph checks it when traced)."""
    if not _on or x.shape[1] != 1 or x.shape[0] > kernels.max_rows(torch.int8) or x.device.type != "cpu":
        return None
    if x.dtype not in (torch.float32, torch.bfloat16) or not kernels.uses_block_kernel():
        return None
    first = caches[0].self_kv
    if blocks.training or first.slots is None or first.slots.numel() != 1:
        return None
    if any(layer.self_kv.slots is not first.slots for layer in caches):  # one column for every block, as StaticLM
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in blocks.parameters())):
        return None
    compiling = torch.compiler.is_compiling()
    known = None if compiling else _PLANS.get(first)
    if known is not None and known[0] == x.dtype:
        return _rows_fit(known[1], x)
    plans = None
    if len(blocks) and all(fits(block) and _dtypes_fit(block, x.dtype) for block in blocks) and _alike(blocks):
        plans = arguments(blocks, x.dtype)
    if not compiling:
        _PLANS[first] = (x.dtype, plans)
    return _rows_fit(plans, x)


def _rows_fit(plans: StackArguments | None, x: Tensor) -> StackArguments | None:
    """``plans`` where the kernels take ``x``'s rows: up to ``max_rows`` of its dtype, or of int8 where every
    projection has int8 codes."""
    if plans is None or x.shape[0] <= kernels.max_rows(x.dtype):
        return plans
    return plans if all(scale is not None for scale in plans.scales) else None


def applies(blocks: nn.ModuleList, x: Tensor, caches: list) -> bool:
    """Whether :func:`step` runs this decode step (:func:`plan`)."""
    return plan(blocks, x, caches) is not None


def _dtypes_fit(block: TransformerBlock, dtype: torch.dtype) -> bool:
    """The norms' weights in the activations' dtype; each projection's weight too, or int8 codes."""
    if block.self_attn_norm.weight.dtype != dtype or block.ff_norm.weight.dtype != dtype:
        return False
    for proj in _projections(block):
        if isinstance(proj, Int8Linear):
            continue
        if proj.weight.dtype != dtype or (proj.bias is not None and proj.bias.dtype != dtype):
            return False
    return True


def _projections(block: TransformerBlock) -> tuple[nn.Module, ...]:
    return block.self_attn.in_proj, block.self_attn.out_proj, block.ff.up, block.ff.down


def step(stack: StackArguments, x: Tensor, caches: list, keys: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """The blocks (their :class:`StackArguments`) for one new token per row, ``x (B, 1, C)``: block ``i``'s key and
    value go to column ``caches[i].slots`` of ``caches[i]`` (a :class:`tformer.generation.static.StaticKVCache`);
    each attends to the columns ``j <= slot`` that ``keys (B, S)`` marks. ``rope``: the token's angles, ``cos, sin``
    of ``B * D/2`` values (:class:`tformer.positions.RotaryEmbedding`). Returns the last block's output
    ``(B, 1, C)``."""
    for cache in caches:
        if (
            cache.k is None
        ):  # a one-token prompt: the first write allocates the storage, as a static cache's update does
            shape = (x.shape[0], stack.num_kv_heads, cache.capacity, stack.head_dim)
            cache.k, cache.v = x.new_zeros(shape), x.new_zeros(shape)
    cos, sin = rope
    return torch.ops.tformer.decode_blocks(
        x,
        stack.norms,
        stack.eps,
        stack.weights,
        stack.scales,
        stack.biases,
        cos,
        sin,
        [cache.k for cache in caches],
        [cache.v for cache in caches],
        caches[0].slots,
        keys,
        stack.num_heads,
        stack.interleaved,
    )


__all__ = ["StackArguments", "applies", "arguments", "enabled", "fits", "plan", "step"]
