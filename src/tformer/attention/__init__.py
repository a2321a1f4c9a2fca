"""Attention backends: one table, one signature, one documented rule for ``"auto"``.

Every backend computes ``Attention(Q, K, V) = softmax(Q K^T * scale + mask) V`` (Vaswani et al. 2017, eq. 1) with the
library's mask convention (:mod:`tformer.functional`), and has the signature of :data:`AttentionFn`::

    run(query (..., H, L, D), key (..., Hkv, S, D), value (..., Hkv, S, Dv),
        attn_mask, is_causal, scale, dropout_p) -> (..., H, L, Dv)

==========  ==========================================================================  =======  ===================
name        what                                                                        dropout  devices
==========  ==========================================================================  =======  ===================
reference   :func:`tformer.functional.reference_attention`: scores materialized, O(L S)  yes      any
sdpa        :func:`sdpa_attention`: PyTorch's fused kernels, under two rules             yes      any
tiled       :func:`tformer.attention.tiled.tiled_attention`: online softmax in PyTorch   no       any
triton      :func:`tformer.attention.triton.triton_attention`: the same as Triton kernels no       CUDA (or Triton's
                                                                                                 CPU interpreter)
==========  ==========================================================================  =======  ===================

``"auto"`` is the rule :func:`auto_backend`: PyTorch's SDPA, on every device (the fastest exact backend measured on
the CPU, and on CUDA FlashAttention-2, memory-efficient or cuDNN kernels; BENCHMARKS.md, "Attention").

Other packages add backends with :func:`register` (the engine's CPU decode kernel: :mod:`tformer.engine`); a model
takes one by name like the built-in ones. ``TransformerConfig.attn_backend``'s choices are ``("auto", *BUILTIN)``
(:data:`BACKEND_NAMES`; a test holds them equal).

:func:`scaled_dot_product_attention` checks its arguments and dispatches; :func:`attend` dispatches without the
checks, for callers whose tensors are right by construction (:class:`tformer.layers.MultiHeadAttention`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.attention.tiled import tiled_attention
from tformer.attention.triton import triton_attention
from tformer.functional import check_attention_args, merge_masks, reference_attention

AttentionFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None", bool, "float | None", float], Tensor]


# Longest key sequence for which bfloat16 attention on the CPU runs faster in float32 (see below).
CPU_BF16_FLOAT32_MAX_KEYS = 256


def cpu_attention_in_float32(query: Tensor, key: Tensor) -> bool:
    """Whether PyTorch's CPU attention kernel is faster on these half-precision inputs cast to float32: float16
    always (its half-precision path is slow at every length), bfloat16 up to :data:`CPU_BF16_FLOAT32_MAX_KEYS` keys
    (its backward's fixed cost dominates short sequences). Measured: BENCHMARKS.md, "Attention"; the casts are O(n)
    and float32 is the more accurate of the two."""
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
    flash kernel, as PyTorch picks) under two rules: ``attn_mask`` together with ``is_causal`` (PyTorch refuses the
    pair) merged into one mask, and half precision on the CPU computed in float32 where :func:`cpu_attention_in_float32`
    says it is faster (cast back: callers see their own dtype). Grouped-query heads go through PyTorch's
    ``enable_gqa``."""
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


@dataclass(frozen=True)
class Backend:
    """One attention implementation: its name, its function and whether it implements attention dropout."""

    name: str
    run: AttentionFn
    dropout: bool


def _without_dropout(fn: Callable[..., Tensor]) -> AttentionFn:
    """``fn(q, k, v, mask, is_causal, scale)`` in the backend signature (the registry refuses dropout first)."""

    def run(query, key, value, attn_mask, is_causal, scale, dropout_p):
        return fn(query, key, value, attn_mask, is_causal, scale)

    return run


BUILTIN: tuple[Backend, ...] = (
    Backend("reference", reference_attention, dropout=True),
    Backend("sdpa", sdpa_attention, dropout=True),
    Backend("tiled", _without_dropout(tiled_attention), dropout=False),
    Backend("triton", _without_dropout(triton_attention), dropout=False),
)
BACKENDS: dict[str, Backend] = {backend.name: backend for backend in BUILTIN}  # and those :func:`register` adds
BACKEND_NAMES: tuple[str, ...] = ("auto", *(backend.name for backend in BUILTIN))


def register(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` under its name (registering the same object again does nothing);
    ``ValueError`` for ``"auto"`` or a name another backend has."""
    known = BACKENDS.get(backend.name)
    if backend.name == "auto" or (known is not None and known is not backend):
        raise ValueError(f"an attention backend named {backend.name!r} exists already; choose another name")
    BACKENDS[backend.name] = backend
    return backend


def auto_backend() -> str:
    """The backend ``"auto"`` names: ``"sdpa"`` (the module docstring gives the measurements behind the rule)."""
    return "sdpa"


def resolve(name: str) -> Backend:
    """The backend ``name`` names (``"auto"`` by :func:`auto_backend`); ``ValueError`` listing the names otherwise."""
    if name == "auto":
        name = auto_backend()
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return backend


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
    backend: Backend,
) -> Tensor:
    """:func:`scaled_dot_product_attention` on ``backend`` without the argument checks.

    For callers whose query, key and value are right by construction, such as
    :class:`tformer.layers.MultiHeadAttention`: decoding one token is ~100 small calls, and the checks
    cost a few microseconds per call, a few percent of a decode step.
    """
    if dropout_p > 0.0 and not backend.dropout:
        raise ValueError(
            f"backend {backend.name!r} does not implement attention dropout (dropout_p={dropout_p}); "
            "use backend='sdpa' or 'reference', or set dropout_p=0"
        )
    return backend.run(query, key, value, attn_mask, is_causal, scale, dropout_p)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """``Attention(Q, K, V) = softmax(Q K^T * scale + mask) V`` (Vaswani et al. 2017, eq. 1) on a chosen backend.

    Args follow ``torch.nn.functional.scaled_dot_product_attention``:
        query ``(..., H, L, D)``, key ``(..., Hkv, S, D)``, value ``(..., Hkv, S, Dv)`` -> ``(..., H, L, Dv)``.
        attn_mask: boolean (``True`` = may attend) or float (added to the scores), broadcastable to
            ``(..., L, S)``. May be combined with ``is_causal`` (both apply).
        is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned when ``L != S``).
        scale: defaults to ``1/sqrt(D)``.
        dropout_p: dropout on the attention weights (backends ``reference`` and ``sdpa``).
        backend: a name of :data:`BACKENDS` or ``"auto"`` (:func:`auto_backend`).
    Grouped-query attention: key/value may have fewer heads (dim -3) than the query when it divides
    the query's head count; query head ``j`` uses key/value head ``j // (H/Hkv)``.
    A query row with no key it may attend to returns zeros and zero gradient.
    """
    check_attention_args(query, key, value, attn_mask)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    return attend(query, key, value, attn_mask, is_causal, scale, dropout_p, resolve(backend))


__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "BUILTIN",
    "CPU_BF16_FLOAT32_MAX_KEYS",
    "AttentionFn",
    "Backend",
    "attend",
    "auto_backend",
    "cpu_attention_in_float32",
    "register",
    "resolve",
    "scaled_dot_product_attention",
    "sdpa_attention",
]
