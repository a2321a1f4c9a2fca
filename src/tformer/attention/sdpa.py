"""PyTorch's fused attention kernels (``torch.nn.functional.scaled_dot_product_attention``) under tformer's rules.

Three rules make PyTorch's function fit the library's convention and its CPU measurements:

* decoding on the CPU: a few query rows (at most ``tformer.engine.kernels.MAX_ROWS``), float32 or bfloat16, a boolean mask
  or none, no dropout and no gradient (a decode step) run on tformer's attention kernel
  (:func:`tformer.engine.kernels.attention`): PyTorch's CPU flash kernel has a fixed cost of ~40 us a call, made for long
  queries, that was most of a decode step's attention (BENCHMARKS.md "Attention kernel for CPU decoding").
* ``attn_mask`` together with ``is_causal``: PyTorch refuses the pair; both are merged into one mask instead.
* half precision on the CPU: PyTorch's CPU kernel is faster on half-precision inputs cast to float32 in the cases of
  :func:`cpu_attention_in_float32` (measured, BENCHMARKS.md "Half precision on the CPU"); the result is cast back,
  so callers see their own dtype either way.

Shapes: H, Hkv, L, S, D, Dv (the package legend, :mod:`tformer`). Query ``(..., H, L, D)``, key ``(..., Hkv, S, D)``,
value ``(..., Hkv, S, Dv)`` -> ``(..., H, L, Dv)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.engine import kernels
from tformer.functional import merge_masks

# Longest key sequence for which bfloat16 attention on the CPU runs faster in float32 (see below).
CPU_BF16_FLOAT32_MAX_KEYS = 256


def cpu_attention_in_float32(query: Tensor, key: Tensor) -> bool:
    """Whether PyTorch's CPU attention kernel is faster on these half-precision inputs cast to float32.

    Measured with torch 2.13 on 2 AVX-512 cores (BENCHMARKS.md, "Half precision on the CPU"):
    * float16: the kernel's half-precision path is slow at every length (forward + backward 3.8x slower than
      float32 at 64 keys, 7.3x at 1024), so float16 always runs in float32;
    * bfloat16: the backward has a fixed per-call cost that dominates short sequences (forward + backward 2.9x
      slower than float32 at 64 keys, 1.3x at 256); from 512 keys on, bfloat16 is 1.25x faster.
    Float32 is also the more accurate of the two, and the casts of q, k, v and the output are O(n).
    """
    if query.dtype not in (torch.float16, torch.bfloat16) or query.device.type != "cpu":  # float32 decides first
        return False
    return query.dtype == torch.float16 or key.shape[-2] <= CPU_BF16_FLOAT32_MAX_KEYS


def sdpa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """``softmax(Q K^T * scale + mask) V`` on PyTorch's fused kernels (flash, memory-efficient, cuDNN or the C++ CPU
    flash kernel, as PyTorch picks), with the three rules of the module docstring. Grouped-query heads go through
    PyTorch's ``enable_gqa``."""
    if kernels.uses_attention_kernel(query, key, value, attn_mask, dropout_p):
        return kernels.attention(query, key, value, attn_mask, is_causal, scale)
    if cpu_attention_in_float32(query, key):
        with torch.autocast("cpu", enabled=False):  # autocast would cast the float32 inputs back down
            out = sdpa_attention(query.float(), key.float(), value.float(), attn_mask, is_causal, scale, dropout_p)
        return out.to(query.dtype)
    if attn_mask is not None and is_causal:
        attn_mask, is_causal = merge_masks(attn_mask, True, query.shape[-2], key.shape[-2]), False
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    gqa = query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
