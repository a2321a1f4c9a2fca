"""Exact attention in tiles with an online softmax (FlashAttention-2), forward and backward, in PyTorch.

Shapes: B, H, Hkv, G, L, S, D, Dv and, inside the tile loops, BH (the B * Hkv problems), Lt, St and R = Lt * G
rows of a query tile (the package legend, :mod:`tformer`).

The score matrix ``Z = Q K^T * scale + mask`` of shape (L, S) is never formed: queries are cut into
tiles of ``block_q`` positions and keys into tiles of ``block_k`` positions, and only one (R, St) tile
of scores exists at a time. Extra memory is O((L + S) * D + R * St), forward and backward.

Row statistics and the softmax exponent use base 2: ``exp(x) = 2^(x log2 e)``. ``torch.exp2`` runs
about 2x faster than ``torch.exp`` on CPU and does not slow down on strongly negative arguments,
where ``torch.exp`` falls into a slow path for denormal results; ``log2 e`` is folded into the scale.

Mask convention (the one of ``torch.nn.functional.scaled_dot_product_attention``): a boolean mask is
True where a query may attend, a float mask is added to the scores; a row that may attend to nothing
returns 0 and gets zero gradients.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from tformer.functional import reference_attention

LOG2E = math.log2(math.e)
DEFAULT_BLOCK = (256, 256)  # (query positions, keys) per tile; fastest measured on CPU, see BENCHMARKS.md


class _Layout:
    """How the user's shapes map onto the canonical 3-D problem, and back.

    Canonical tensors: ``q (BH, L*G, D)`` with rows ordered (position, group head) so that a contiguous
    range of query positions is a contiguous range of rows; ``k (BH, S, D)``; ``v (BH, S, Dv)``.
    The mask is kept as a broadcastable view of shape ``(*batch, Hkv|1, L|1, G|1, S|1)``, never expanded.
    """

    def __init__(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None):
        if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
            raise ValueError("tiled_attention needs query (..., L, D), key (..., S, D), value (..., S, Dv)")
        if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
            raise ValueError(
                f"shape mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if attn_mask is not None and attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool (True = may attend) or floating; got {attn_mask.dtype}")
        self.out_ndim = max(t.dim() for t in (query, key, value, attn_mask) if t is not None)
        self.ndim = max(self.out_ndim, 3)
        q, k, v = (_pad_dims(t, self.ndim) for t in (query, key, value))
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if hk != hv and 1 not in (hk, hv):
            raise ValueError(f"key and value head counts differ: {hk} vs {hv}")
        hkv = max(hk, hv)
        if hq % hkv == 0:
            self.groups, self.heads = hq // hkv, hq  # grouped-query (or plain, groups == 1) attention
        elif hq == 1:
            self.groups, self.heads = 1, hkv  # one query head broadcast over the key/value heads
        else:
            raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
        self.kv_heads = self.heads // self.groups
        batch_shapes = [t.shape[:-3] for t in (q, k, v)]
        if attn_mask is not None and attn_mask.dim() >= 3:
            batch_shapes.append(attn_mask.shape[:-3])
        self.batch = tuple(torch.broadcast_shapes(*batch_shapes))
        self.lead = (*self.batch, self.kv_heads)  # the BH = B * Hkv independent problems
        self.L, self.S, self.D, self.Dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
        self._q, self._k, self._v, self._mask = q, k, v, attn_mask

    def canonical(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Differentiable views (copies only where a broadcast or the GQA row order requires one)."""
        G, L, D = self.groups, self.L, self.D
        q = self._q.expand(*self.batch, self._q.shape[-3], L, D)
        if q.shape[-3] == 1 and self.heads > 1:
            q = q.expand(*self.batch, self.heads, L, D)
        q = q.unflatten(-3, (self.kv_heads, G)).transpose(-3, -2)  # (*batch, Hkv, L, G, D)
        q = q.reshape(-1, L * G, D)  # (BH, L*G, D); rows ordered (position, head in group)
        k = self._k.expand(*self.lead, self.S, D).reshape(-1, self.S, D)  # (BH, S, D)
        v = self._v.expand(*self.lead, self.S, self.Dv).reshape(-1, self.S, self.Dv)  # (BH, S, Dv)
        return q, k, v, self._canonical_mask()

    def _canonical_mask(self) -> Tensor | None:
        mask = self._mask
        if mask is None:
            return None
        mask = _pad_dims(mask, len(self.batch) + 3)  # (*batch|1, H|1, L|1, S|1)
        lm, sm = mask.shape[-2:]
        if lm not in (1, self.L) or sm not in (1, self.S) or mask.shape[-3] not in (1, self.heads):
            raise ValueError(f"attn_mask {tuple(mask.shape)} does not broadcast to (..., {self.L}, {self.S})")
        if mask.shape[-3] == 1:
            return mask.unsqueeze(-2)  # (*batch|1, 1, L|1, 1, S|1)
        mask = mask.unflatten(-3, (self.kv_heads, self.groups))  # (*batch|1, Hkv, G, L|1, S|1)
        return mask.transpose(-3, -2)  # (*batch|1, Hkv, L|1, G, S|1): a view, no copy

    def output(self, out: Tensor) -> Tensor:
        """``(BH, L*G, Dv)`` -> ``(*batch, H, L, Dv)`` (without the head dim for 2-D inputs)."""
        out = out.view(*self.lead, self.L, self.groups, self.Dv).transpose(-3, -2)  # (*batch, Hkv, G, L, Dv)
        out = out.reshape(*self.batch, self.heads, self.L, self.Dv)
        return out.view(out.shape[len(out.shape) - self.out_ndim :])


def _pad_dims(t: Tensor, ndim: int) -> Tensor:
    return t.view((1,) * (ndim - t.dim()) + tuple(t.shape)) if t.dim() < ndim else t


def _tile(mask: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
    """Queries ``i0:i1`` and keys ``j0:j1`` of a canonical mask view (broadcast dims stay size 1)."""
    rows = slice(i0, i1) if mask.shape[-3] > 1 else slice(None)
    cols = slice(j0, j1) if mask.shape[-1] > 1 else slice(None)
    return mask[..., rows, :, cols]  # (*batch|1, Hkv|1, Lt|1, G|1, St|1)


class _Tiler:
    """Score tiles ``log2(e) * (Q_i K_j^T * scale + mask_ij) - shift`` with masking and skipping.

    Args: ``lead`` the batch shape of the BH problems, ``groups`` G, the canonical ``mask`` view or None.
    """

    def __init__(self, lead: tuple[int, ...], groups: int, mask: Tensor | None, is_causal: bool):
        self.lead, self.groups, self.mask, self.is_causal = lead, groups, mask, is_causal
        self._flat: dict[str, Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A contiguous scratch tensor reused across tiles (fresh 4 MB allocations cost page faults)."""
        numel = math.prod(shape)
        if name not in self._flat or self._flat[name].numel() < numel:
            self._flat[name] = like.new_empty(numel)
        return self._flat[name][:numel].view(shape)

    def key_end(self, i1: int, S: int) -> int:
        """Keys past this end are above the causal diagonal for every query before ``i1``."""
        return min(S, i1) if self.is_causal else S

    def mask_tile(self, i0: int, i1: int, j0: int, j1: int) -> Tensor | None:
        return None if self.mask is None else _tile(self.mask, i0, i1, j0, j1)

    @staticmethod
    def is_empty(tile: Tensor | None) -> bool:
        """True when the mask forbids every entry of the tile (the tile is then skipped)."""
        if tile is None:
            return False
        return not bool(tile.any()) if tile.dtype == torch.bool else bool(torch.isneginf(tile).all())

    def scores(self, qc_i: Tensor, k_j: Tensor, tile: Tensor | None, i0: int, j0: int, shift: Tensor | None):
        """``qc_i (BH, R, D)`` (already times ``scale * log2 e``), ``k_j (BH, St, D)`` -> ``(BH, R, St)``.

        ``shift (BH, R)`` is subtracted inside the matrix product (``baddbmm``), saving a pass.
        """
        s = self.buffer("s", (qc_i.shape[0], qc_i.shape[1], k_j.shape[1]), qc_i)
        if shift is None:
            torch.bmm(qc_i, k_j.transpose(1, 2), out=s)  # (BH, R, D) @ (BH, D, St) -> (BH, R, St)
        else:
            torch.baddbmm(shift.unsqueeze(-1).neg(), qc_i, k_j.transpose(1, 2), out=s)
        lt, c = qc_i.shape[1] // self.groups, k_j.shape[1]
        s5 = s.view(*self.lead, lt, self.groups, c)  # (*batch, Hkv, Lt, G, St)
        if self.is_causal and j0 + c - 1 > i0:  # the tile reaches above the diagonal
            keys = torch.arange(j0, j0 + c, device=s.device)
            above = keys > torch.arange(i0, i0 + lt, device=s.device)[:, None]  # (Lt, St)
            s5.masked_fill_(above.unsqueeze(1), -math.inf)
        if tile is not None and tile.dtype == torch.bool:
            s5.masked_fill_(tile.logical_not(), -math.inf)
        elif tile is not None:
            s5.add_(tile, alpha=LOG2E)
        return s


def _blocks(block_size: int | tuple[int, int] | None) -> tuple[int, int]:
    if block_size is None:
        return DEFAULT_BLOCK
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    if bq < 1 or bk < 1:
        raise ValueError(f"block sizes must be positive; got {block_size}")
    return bq, bk


def _forward(q, k, v, tiler: _Tiler, scale: float, bq: int, bk: int) -> tuple[Tensor, Tensor]:
    """Online softmax over key tiles (formulae in :func:`tiled_attention`).

    Returns ``out (BH, L*G, Dv)`` and the base-2 log-sum-exp ``lse2 (BH, L*G)``, ``+inf`` for rows that
    may attend nothing (so the backward's ``P = 2^(z - lse2)`` is exactly 0 there).
    """
    BH, _, D = q.shape
    G, L, S, Dv = tiler.groups, q.shape[1] // tiler.groups, k.shape[1], v.shape[-1]
    qc = q * (scale * LOG2E)  # (BH, L*G, D)
    out, lse2 = q.new_empty(BH, L * G, Dv), q.new_empty(BH, L * G)
    lowest = torch.finfo(q.dtype).min
    for i0 in range(0, L, bq):
        i1 = min(i0 + bq, L)
        rows = slice(i0 * G, i1 * G)
        m = q.new_full((BH, (i1 - i0) * G), -math.inf)
        l = q.new_zeros(BH, (i1 - i0) * G)
        acc = q.new_zeros(BH, (i1 - i0) * G, Dv)
        for j0 in range(0, tiler.key_end(i1, S), bk):
            j1 = min(j0 + bk, S)
            tile = tiler.mask_tile(i0, i1, j0, j1)
            if tiler.is_empty(tile):
                continue
            s = tiler.scores(qc[:, rows], k[:, j0:j1], tile, i0, j0, None)  # (BH, R, St)
            m_new = torch.maximum(m, s.amax(dim=-1))  # (BH, R)
            m_use = m_new.clamp(min=lowest)  # finite even for rows with nothing allowed yet
            p = s.sub_(m_use.unsqueeze(-1)).exp2_()  # 2^(z' - m'), in place
            alpha = torch.exp2(m - m_use)  # 2^(m - m'); 0 when m = -inf
            l.mul_(alpha).add_(p.sum(dim=-1))
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p, v[:, j0:j1])  # (BH, R, St) @ (BH, St, Dv)
            m = m_new
        seen = l > 0
        l = torch.where(seen, l, 1.0)
        out[:, rows] = acc / l.unsqueeze(-1)
        lse2[:, rows] = torch.where(seen, m + torch.log2(l), math.inf)
    return out, lse2


def _backward(q, k, v, out, lse2, dout, tiler: _Tiler, scale: float, bq: int, bk: int, mask_grad: bool):
    """FlashAttention-2 backward (formulae in :func:`tiled_attention`): P is recomputed tile by tile.

    The outer loop runs over key tiles (dK_j and dV_j finish in one pass), the inner one over query
    tiles, accumulating dQ_i in place.
    """
    G, L, S = tiler.groups, q.shape[1] // tiler.groups, k.shape[1]
    qc = q * (scale * LOG2E)
    delta = (dout * out).sum(dim=-1)  # rowsum(dO * O), (BH, L*G)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dmask = torch.zeros_like(tiler.mask) if mask_grad else None
    for j0 in range(0, S, bk):
        j1 = min(j0 + bk, S)
        k_j, v_j, dk_j, dv_j = k[:, j0:j1], v[:, j0:j1], dk[:, j0:j1], dv[:, j0:j1]
        first = (j0 // bq) * bq if tiler.is_causal else 0  # earlier query tiles see none of these keys
        for i0 in range(first, L, bq):
            i1 = min(i0 + bq, L)
            rows = slice(i0 * G, i1 * G)
            tile = tiler.mask_tile(i0, i1, j0, j1)
            if tiler.is_empty(tile):
                continue
            p = tiler.scores(qc[:, rows], k_j, tile, i0, j0, lse2[:, rows]).exp2_()  # P tile (BH, R, St)
            dv_j.baddbmm_(p.transpose(1, 2), dout[:, rows])  # (BH, St, R) @ (BH, R, Dv)
            ds = tiler.buffer("ds", p.shape, p)
            torch.baddbmm(delta[:, rows].unsqueeze(-1).neg(), dout[:, rows], v_j.transpose(1, 2), out=ds)
            ds.mul_(p)  # dZ = P * (dP - delta), (BH, R, St)
            if dmask is not None:
                dm = _tile(dmask, i0, i1, j0, j1)
                dm.add_(ds.view(*tiler.lead, i1 - i0, G, j1 - j0).sum_to_size(dm.shape))
            dq[:, rows].baddbmm_(ds, k_j, alpha=scale)  # (BH, R, St) @ (BH, St, D)
            dk_j.baddbmm_(ds.transpose(1, 2), q[:, rows], alpha=scale)  # (BH, St, R) @ (BH, R, D)
    return dq, dk, dv, dmask


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, lead, groups, is_causal, scale, bq, bk):
        tiler = _Tiler(lead, groups, mask, is_causal)
        out, lse2 = _forward(q, k, v, tiler, scale, bq, bk)
        ctx.save_for_backward(q, k, v, mask, out, lse2)
        ctx.args = (lead, groups, is_causal, scale, bq, bk)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, mask, out, lse2 = ctx.saved_tensors
        lead, groups, is_causal, scale, bq, bk = ctx.args
        tiler = _Tiler(lead, groups, mask, is_causal)
        mask_grad = mask is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dmask = _backward(q, k, v, out, lse2, dout.contiguous(), tiler, scale, bq, bk, mask_grad)
        return dq, dk, dv, dmask, None, None, None, None, None, None


def tiled_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    block_size: int | tuple[int, int] | None = None,
) -> Tensor:
    """``softmax(Q K^T * scale + mask) V`` computed tile by tile (Dao 2023, FlashAttention-2, Alg. 1-2).

    Args (the semantics of ``torch.nn.functional.scaled_dot_product_attention``):
        query ``(..., H, L, D)``, key ``(..., Hkv, S, D)``, value ``(..., Hkv, S, Dv)`` -> ``(..., H, L, Dv)``;
            leading dims broadcast; ``H`` a multiple of ``Hkv`` is grouped-query attention (query head
            ``h`` uses key/value head ``h // (H / Hkv)``): key and value are shared, not copied (the
            query rows are reordered once, O(L * D)).
        attn_mask: bool (True = may attend) or float (added to the scores), broadcastable to
            ``(..., H, L, S)``; sliced tile by tile, never expanded. A float mask that requires grad
            receives one (reduced to its own shape).
        is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned); tiles above the diagonal are
            skipped. Combined with ``attn_mask``, both apply.
        scale: defaults to ``1 / sqrt(D)``.
        block_size: positions per tile, an int for both or ``(query, key)``; default ``DEFAULT_BLOCK``.

    Forward, per query row, with scores in base 2, ``z_j = log2(e) * (q.k_j * scale + mask_j)``: after
    some key tiles the state is ``m = max z``, ``l = sum 2^(z - m)``, ``acc = sum 2^(z - m) v``; the
    next tile with scores ``z'`` and values ``v'`` updates it as::

        m'   = max(m, max z')
        l'   = 2^(m - m') l   + sum_j 2^(z'_j - m')
        acc' = 2^(m - m') acc + sum_j 2^(z'_j - m') v'_j

    and at the end ``out = acc / l``, ``lse2 = m + log2 l``. Every exponent is <= 0, so nothing
    overflows, even for scores near 1e4; a row with no allowed key keeps ``l = 0`` and returns 0.
    Only ``out`` and ``lse2`` are kept for the backward, which recomputes ``P = 2^(z - lse2)`` tile by
    tile and, with ``delta = rowsum(dO * out)`` (equal to ``rowsum(P * dP)``), forms::

        dV = P^T dO,   dP = dO V^T,   dZ = P * (dP - delta),   dQ = scale * dZ K,   dK = scale * dZ^T Q

    (and ``d(float mask) = dZ`` summed over the mask's broadcast dims).
    Statistics and accumulators are float32 (float64 for float64 inputs); the result has the input dtype.
    Memory beyond inputs and outputs: O((L + S) * D + block_q * block_k) per problem, never O(L * S).
    """
    if query.shape[-2] == 0 or key.shape[-2] == 0:  # no tile: an empty result, or zeros for rows with no key
        return reference_attention(query, key, value, attn_mask, is_causal, scale)
    layout = _Layout(query, key, value, attn_mask)
    scale = 1.0 / math.sqrt(layout.D) if scale is None else float(scale)
    bq, bk = _blocks(block_size)
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k, v, mask = layout.canonical()
    q, k, v = (t.to(compute).contiguous() for t in (q, k, v))
    out = _TiledAttention.apply(q, k, v, mask, layout.lead, layout.groups, bool(is_causal), scale, bq, bk)
    return layout.output(out.to(query.dtype))
