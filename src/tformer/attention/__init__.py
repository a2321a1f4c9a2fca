"""Attention backends: one table, one signature, one documented rule for ``"auto"``.

Every backend computes ``Attention(Q, K, V) = softmax(Q K^T * scale + mask) V`` (Vaswani et al. 2017, eq. 1) with the
library's mask convention (:mod:`tformer.functional`), and has the signature of :data:`AttentionFn`::

    run(query (..., H, L, D), key (..., Hkv, S, D), value (..., Hkv, S, Dv),
        attn_mask, is_causal, scale, dropout_p) -> (..., H, L, Dv)

==========  ==========================================================================  =======  ===================
name        what                                                                        dropout  devices
==========  ==========================================================================  =======  ===================
reference   :func:`tformer.functional.reference_attention`: scores materialized, O(L S)  yes      any
sdpa        :func:`tformer.attention.sdpa.sdpa_attention`: PyTorch's fused kernels       yes      any
tiled       :func:`tformer.attention.tiled.tiled_attention`: online softmax in PyTorch   no       any
triton      :func:`tformer.attention.triton.triton_attention`: the same as Triton kernels no       CUDA (or Triton's
                                                                                                 CPU interpreter)
==========  ==========================================================================  =======  ===================

``"auto"`` is the rule :func:`auto_backend`: PyTorch's SDPA, on every device. On the CPU its fused flash kernel was the
fastest exact backend measured (BENCHMARKS.md, "Attention": tiled forward+backward 1.04-1.06x its time on one thread,
1.08-1.21x on two); on CUDA it runs FlashAttention-2, memory-efficient or cuDNN kernels, and Triton is not chosen until
it has been measured against them on a GPU. On the CPU, ``sdpa`` hands decode calls (at most
``tformer.engine.kernels.MAX_ROWS`` query rows, no gradient, a boolean mask) to tformer's attention kernel,
:func:`tformer.engine.kernels.attention` (the rules are :mod:`tformer.attention.sdpa`'s).

:func:`scaled_dot_product_attention` checks its arguments and dispatches; :func:`attend` dispatches without the
checks, for callers whose tensors are right by construction (:class:`tformer.layers.MultiHeadAttention`).
``TransformerConfig.attn_backend``'s choices are ``("auto", *BACKENDS)`` (a test holds them equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from tformer.attention.sdpa import sdpa_attention
from tformer.attention.tiled import tiled_attention
from tformer.attention.triton import triton_attention
from tformer.functional import check_attention_args, reference_attention

AttentionFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None", bool, "float | None", float], Tensor]


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


BACKENDS: dict[str, Backend] = {
    "reference": Backend("reference", reference_attention, dropout=True),
    "sdpa": Backend("sdpa", sdpa_attention, dropout=True),
    "tiled": Backend("tiled", _without_dropout(tiled_attention), dropout=False),
    "triton": Backend("triton", _without_dropout(triton_attention), dropout=False),
}
BACKEND_NAMES: tuple[str, ...] = ("auto", *BACKENDS)


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
    cost ~5 us per attention call (~3% of a decode step of the benchmark model).
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
    "AttentionFn",
    "Backend",
    "attend",
    "auto_backend",
    "resolve",
    "scaled_dot_product_attention",
]
