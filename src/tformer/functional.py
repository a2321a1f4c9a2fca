"""Pure tensor math of the Transformer: attention, the softmax Jacobian, position encodings.

Nothing here holds parameters; the layers in :mod:`tformer.layers` call these functions.

Shapes: B, H, Hkv, L, S, D, Dv, T, C (the package legend, :mod:`tformer`).

The one mask convention of tformer (the same as ``torch.nn.functional.scaled_dot_product_attention``):
    * a boolean mask is ``True`` where a query **may attend** to a key;
    * a float mask is **added** to the scores (``-inf`` forbids a key);
    * masks are applied to the scores *before* the softmax, so the allowed weights still sum to 1;
    * a query row with no key it may attend to returns zeros and receives zero gradient, never NaN.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import Tensor


# --------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------
def causal_mask(num_queries: int, num_keys: int, device: torch.device | str | None = None) -> Tensor:
    """Boolean ``(L, S)`` mask with ``mask[i, j] = j <= i`` (top-left aligned, as PyTorch's ``is_causal``)."""
    if num_queries < 0 or num_keys < 0:
        raise ValueError(f"a causal mask needs sizes >= 0; got num_queries={num_queries}, num_keys={num_keys}")
    rows = torch.arange(num_queries, device=device)[:, None]
    cols = torch.arange(num_keys, device=device)[None, :]
    return cols <= rows


def merge_masks(attn_mask: Tensor | None, is_causal: bool, num_queries: int, num_keys: int) -> Tensor | None:
    """One mask equal to ``attn_mask`` AND the causal mask (float masks get ``-inf`` above the diagonal)."""
    if not is_causal:
        return attn_mask
    device = attn_mask.device if attn_mask is not None else None
    causal = causal_mask(num_queries, num_keys, device)
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


def check_attention_args(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None) -> None:
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise ValueError(
            f"attention needs query (..., L, D), key (..., S, D), value (..., S, Dv); got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must share the last (head) dimension D; got query D={query.shape[-1]}, "
            f"key D={key.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S; got key S={key.shape[-2]}, value S={value.shape[-2]}"
        )
    if not (query.dtype == key.dtype == value.dtype) or not query.is_floating_point():
        raise ValueError(
            f"query, key and value must share one floating dtype; got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if query.dim() >= 3 and key.dim() >= 3:
        hq, hkv = query.shape[-3], key.shape[-3]
        if hq != hkv and (hkv == 0 or hq % hkv != 0) and hkv != 1:
            raise ValueError(
                f"grouped-query attention needs the query heads ({hq}) to be a multiple of the key/value heads "
                f"({hkv}); choose num_kv_heads dividing num_heads"
            )
    if query.dim() >= 3 and value.dim() >= 3 and key.shape[-3] != value.shape[-3]:
        raise ValueError(
            f"key and value must have the same number of heads (dim -3); got key {key.shape[-3]}, "
            f"value {value.shape[-3]}"
        )
    if query.shape[-1] == 0:
        raise ValueError("the head dimension D of query and key must be at least 1; got D=0")
    if attn_mask is not None:
        check_mask(attn_mask, query, key)


def check_mask(attn_mask: Tensor, query: Tensor, key: Tensor) -> None:
    """``ValueError`` unless ``attn_mask`` is boolean or floating and broadcasts to the scores ``(..., L, S)``."""
    _check_mask_dtype(attn_mask)
    L, S = query.shape[-2], key.shape[-2]
    shape = tuple(attn_mask.shape)
    fits = len(shape) >= 2 and shape[-2] in (1, L) and shape[-1] in (1, S)
    if fits:
        try:
            torch.broadcast_shapes(shape[:-2], tuple(query.shape[:-2]))  # the batch and head dims
        except RuntimeError:
            fits = False
    if not fits:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the scores (..., L={L}, S={S}) of "
            f"query {tuple(query.shape)} and key {tuple(key.shape)}; give a mask of shape (L, S), (B, 1, L, S) or "
            f"(B, 1, 1, S) (key padding)"
        )


def _check_mask_dtype(attn_mask: Tensor) -> None:
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(
            f"attn_mask must be boolean (True = may attend) or floating (added to the scores); got dtype "
            f"{attn_mask.dtype} (an integer 0/1 mask: pass mask.bool())"
        )


def _group_query_heads(query: Tensor, key: Tensor) -> tuple[Tensor, int]:
    """View ``query (..., H, L, D)`` as ``(..., Hkv, H/Hkv, L, D)`` when key has fewer heads (no copy).

    Query head ``j`` then meets key/value head ``j // (H/Hkv)`` (the ``repeat_interleave`` convention of
    Llama and of PyTorch's ``enable_gqa``). Returns the (possibly) regrouped query and the group size.
    """
    if query.dim() < 3 or key.dim() < 3 or query.shape[-3] == key.shape[-3] or key.shape[-3] == 1:
        return query, 1
    groups = query.shape[-3] // key.shape[-3]
    *lead, h, length, e = query.shape
    return query.reshape(*lead, h // groups, groups, length, e), groups


def _kv_for_groups(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.unsqueeze(-3)  # (..., Hkv, S, D) -> (..., Hkv, 1, S, D)


def _mask_for_groups(mask: Tensor | None, groups: int) -> Tensor | None:
    """Reshape a mask broadcastable to ``(..., H, L, S)`` so it broadcasts to ``(..., Hkv, g, L, S)``."""
    if mask is None or groups == 1:
        return mask
    if mask.dim() < 3 or mask.shape[-3] == 1:
        return mask.unsqueeze(-3) if mask.dim() >= 3 else mask
    *lead, h, length, s = mask.shape
    return mask.reshape(*lead, h // groups, groups, length, s)


# --------------------------------------------------------------------------------------------------
# Reference attention, written out step by step
# --------------------------------------------------------------------------------------------------
def attention_scores(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Masked, scaled logits ``Z = Q K^T * scale`` with forbidden entries set to ``-inf``.

    Shapes: ``query (..., L, D)``, ``key (..., S, D)`` -> ``(..., L, S)``. Default ``scale = 1/sqrt(D)``:
    with iid unit-variance entries ``Var(q.k) = D``, so dividing by ``sqrt(D)`` restores unit variance.
    """
    if attn_mask is not None:
        _check_mask_dtype(attn_mask)  # an integer 0/1 mask would be added to the scores, not applied
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale  # (..., L, D) @ (..., D, S) -> (..., L, S)
    mask = merge_masks(attn_mask, is_causal, query.shape[-2], key.shape[-2])
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)  # a float64 mask on float32 scores keeps the scores' dtype


def masked_softmax(scores: Tensor) -> Tensor:
    """Row softmax of ``scores (..., S)`` where a row that is all ``-inf`` gives zeros (and zero gradient).

    ``a_i = exp(z_i - max z) / sum_j exp(z_j - max z)``. An all-``-inf`` row would give ``0/0 = NaN``;
    such rows are replaced by finite zeros *before* the softmax and their weights zeroed after it, so
    no NaN enters the forward or the backward pass.
    """
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., 1): rows with nothing to attend
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
    return weights.masked_fill(empty, 0.0)


def attention_weights(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Attention probabilities ``A = softmax(Q K^T / sqrt(D) + mask)`` of shape ``(..., L, S)``.

    Grouped-query shapes (fewer key heads than query heads) are broadcast: query head ``j`` uses key
    head ``j // (H/Hkv)``; the result has the query's head count.
    """
    check_attention_args(query, key, key, attn_mask)
    grouped, groups = _group_query_heads(query, key)
    scores = attention_scores(
        grouped, _kv_for_groups(key, groups), _mask_for_groups(attn_mask, groups), is_causal, scale
    )
    weights = masked_softmax(scores)
    return weights.reshape(*query.shape[:-1], key.shape[-2]) if groups > 1 else weights


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Materialized attention ``softmax(Q K^T * scale + mask) V``; O(L*S) memory. The test oracle.

    1. scores ``Z = Q K^T * scale``                  (..., L, S)
    2. mask: forbidden entries ``-inf`` (before the softmax, so allowed weights renormalize)
    3. ``A = softmax(Z)`` row-wise; empty rows -> 0  (..., L, S)
    4. output ``A V``                                (..., L, Dv)
    """
    grouped, groups = _group_query_heads(query, key)
    scores = attention_scores(
        grouped, _kv_for_groups(key, groups), _mask_for_groups(attn_mask, groups), is_causal, scale
    )
    weights = masked_softmax(scores)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.matmul(weights, _kv_for_groups(value, groups))  # (..., L, S) @ (..., S, Dv) -> (..., L, Dv)
    return out.reshape(*query.shape[:-1], value.shape[-1]) if groups > 1 else out


# --------------------------------------------------------------------------------------------------
# The softmax Jacobian
# --------------------------------------------------------------------------------------------------
def softmax_jacobian(probs: Tensor) -> Tensor:
    """Jacobian of the softmax at output ``a = softmax(z)``: ``J_ij = da_i/dz_j = a_i (delta_ij - a_j)``.

    Shapes: ``probs (..., n)`` -> ``(..., n, n)``. Diagonal ``a_i (1 - a_i)``, off-diagonal ``-a_i a_j``.
    When the softmax saturates (one ``a_i -> 1``, the rest ``-> 0``) every entry goes to 0: no gradient
    flows back to the logits. This is why attention divides the logits by ``sqrt(d_k)``.
    """
    return torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)


def softmax_jacobian_norm(probs: Tensor) -> Tensor:
    """Frobenius norm of :func:`softmax_jacobian` without forming it: ``(..., n) -> (...)``.

    ``||J||^2 = sum_i (a_i - a_i^2)^2 + sum_{i != j} a_i^2 a_j^2 = sum a_i^2 - 2 sum a_i^3 + (sum a_i^2)^2``:
    1/n-ish for a uniform row, 0 for a one-hot (saturated) one.
    """
    p2 = (probs * probs).sum(-1)
    p3 = (probs * probs * probs).sum(-1)
    return (p2 - 2 * p3 + p2 * p2).clamp_min(0).sqrt()


# --------------------------------------------------------------------------------------------------
# Position encodings
# --------------------------------------------------------------------------------------------------
def _frequencies(dim: int, base: float, device=None, dtype=torch.float64) -> Tensor:
    """``omega_i = base^(-2i/dim)`` for ``i = 0 .. dim/2 - 1``."""
    if not base > 0:
        raise ValueError(f"the frequency base must be positive (10000 in the papers); got {base}")
    return base ** (-torch.arange(0, dim, 2, device=device, dtype=dtype) / dim)


def sinusoidal_positional_encoding(
    num_positions: int,
    d_model: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    layout: str = "interleaved",
) -> Tensor:
    """The sinusoidal table of Vaswani et al. (2017, sec. 3.5), shape ``(num_positions, d_model)``.

    ``PE[pos, 2i] = sin(omega_i pos)``, ``PE[pos, 2i+1] = cos(omega_i pos)``, ``omega_i = base^(-2i/d_model)``;
    ``layout="half"`` puts the same pairs in two halves, ``[sin(omega_0 pos) .. | cos(omega_0 pos) ..]`` (Marian).
    Each pair is a point on a circle, so a shift by ``k`` is the fixed rotation
    ``[[cos(omega_i k), sin(omega_i k)], [-sin(omega_i k), cos(omega_i k)]]`` applied to ``(sin, cos)``,
    independent of ``pos``. Computed in float64 then cast, so large positions stay accurate.
    An odd ``d_model`` gets its last (sin) column without a cos partner.
    """
    num_positions, d_model = operator.index(num_positions), operator.index(d_model)  # TypeError for 5.5
    if num_positions < 0 or d_model <= 0:
        raise ValueError(
            f"need num_positions >= 0 and d_model > 0; got num_positions={num_positions}, d_model={d_model}"
        )
    if layout not in ("interleaved", "half"):
        raise ValueError(f"layout must be 'interleaved' or 'half'; got {layout!r}")
    pos = torch.arange(num_positions, device=device, dtype=torch.float64)[:, None]  # (T, 1)
    angles = pos * _frequencies(d_model, base, device)[None, :]  # (T, ceil(C/2))
    sin, cos = torch.sin(angles), torch.cos(angles[:, : d_model // 2])
    if layout == "half":
        return torch.cat([sin, cos], dim=-1).to(dtype)  # (T, C)
    pe = torch.empty(num_positions, d_model, device=device, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = sin, cos
    return pe.to(dtype)


def rotary_cos_sin(positions: Tensor, dim: int, base: float = 10000.0, dtype=torch.float32) -> tuple[Tensor, Tensor]:
    """``cos(m theta_i)``, ``sin(m theta_i)`` of shape ``positions.shape + (dim/2,)``; angles in float64."""
    angles = positions.to(torch.float64)[..., None] * _frequencies(dim, base, positions.device)
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def apply_rotary(
    x: Tensor,
    positions: Tensor | int,
    base: float = 10000.0,
    interleaved: bool = True,
) -> Tensor:
    """Rotary position embedding (RoPE, Su et al. 2021) on the last dimension of ``x (..., T, D)``.

    Each pair of features ``(x_a, x_b)`` of frequency ``theta_i = base^(-2i/D)`` is rotated by the angle
    ``m theta_i`` of its position ``m``: ``x_a' = x_a cos - x_b sin``, ``x_b' = x_a sin + x_b cos``.
    Since ``R(a)^T R(b) = R(b - a)``, the score ``q_m . k_n`` then depends only on ``n - m``.

    Layouts: ``interleaved=True`` pairs ``(x_0, x_1), (x_2, x_3), ...`` (the RoFormer paper, GPT-J);
    ``interleaved=False`` pairs ``(x_i, x_{i + D/2})`` (the "rotate half" layout of GPT-NeoX and Llama).
    ``positions``: an int offset (positions ``offset .. offset+T-1``) or a tensor broadcastable to
    ``x.shape[:-1]`` holding each token's position.
    """
    if x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"rotary embedding turns a floating (..., T, D) tensor; got {x.dtype} {tuple(x.shape)}")
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"rotary embedding needs an even head dimension; got {dim}")
    if not isinstance(positions, Tensor):
        offset = operator.index(positions)  # an int offset (a numpy integer too); TypeError for a float
        positions = torch.arange(offset, offset + x.shape[-2], device=x.device)
    cos, sin = rotary_cos_sin(positions, dim, base, dtype=x.dtype)  # (..., T, D/2)
    return rotate_pairs(x, cos, sin, interleaved)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = True) -> Tensor:
    """Rotate the feature pairs of ``x (..., T, D)`` by angles given as ``cos``, ``sin`` of shape ``(..., T, D/2)``.

    The step of :func:`apply_rotary` after the angles are known; layers call it with cached tables.
    """
    if interleaved:
        x_a, x_b = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x_a * cos - x_b * sin, x_a * sin + x_b * cos), dim=-1)  # (..., T, D/2, 2)
        return out.flatten(-2)  # (..., T, D)
    half = x.shape[-1] // 2
    x_a, x_b = x[..., :half], x[..., half:]
    return torch.cat((x_a * cos - x_b * sin, x_a * sin + x_b * cos), dim=-1)
