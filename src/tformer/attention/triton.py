"""Exact attention as Triton kernels: FlashAttention-2 forward and backward (Dao 2023, Alg. 1-2).

Shapes: B, H, Hkv, G, L, S, D, Dv; BLOCK_M query rows and BLOCK_N keys per tile, BLOCK_D / BLOCK_DV the head
dims rounded up to a power of two (>= 16, as ``tl.dot`` needs) (the package legend, :mod:`tformer`).

The math is that of :mod:`tformer.attention.tiled` (same mask convention, same base-2 online softmax):
one program owns BLOCK_M query rows of one head and walks the key tiles keeping ``m``, ``l``, ``acc``
in float32 registers; it stores ``out = acc / l`` and ``lse2 = m + log2 l`` (``+inf`` for a row that
may attend nothing). The backward recomputes ``P = 2^(z - lse2)`` tile by tile in two kernels, one
over key tiles (dK, dV: each program sums over the G query heads of its key/value head, so no atomics)
and one over query tiles (dQ), with ``delta = rowsum(dO * O)`` computed once in PyTorch.

Tiles: on CUDA, unless the caller fixes them, ``triton.autotune`` times a few (BLOCK_M, BLOCK_N, warps,
pipeline stages) configurations per kernel on the first call for each shape, dtype and mask kind, and keeps
the fastest; in the interpreter the tiles are 16 x 16.

Supported: CUDA tensors (or CPU tensors when triton was imported with ``TRITON_INTERPRET=1``: its
interpreter then runs the kernels with numpy); float16, bfloat16 and float32 (float32 products in
IEEE precision, not TF32); inputs of 2 to 4 dims with equal batch sizes; grouped-query heads;
``is_causal``; any bool or float mask broadcastable to (B, H, L, S) that does not require grad (read
through zero strides, never expanded in memory).
:func:`triton_supports` tells a dispatcher whether a call qualifies. Triton is imported on first use,
so this module imports without it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from tformer.attention.tiled import LOG2E

triton = None  # the triton package and triton.language, bound by _load() on first use
tl = None
_JITTED = False
_AUTOTUNED = {}  # kernel name -> its triton.autotune wrapper (CUDA only), made by _jit_all()
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2


def _load() -> bool:
    """Import triton (once); False if it is not installed."""
    global triton, tl
    if tl is None:
        try:
            import triton as triton_module
            import triton.language as tl_module
        except ImportError:
            return False
        triton, tl = triton_module, tl_module
    return True


def _interpreting() -> bool:
    """Whether triton was imported under ``TRITON_INTERPRET=1``: its own library functions (``tl.max``,
    ``tl.sum``, ...) are then interpreted, and so must ours be. The variable is read at import only."""
    return _load() and type(tl.max).__name__ == "InterpretedFunction"


def _jit_all() -> None:
    """Replace the device functions and kernels below by their jitted versions, once, in the mode
    (compiled or interpreted) of the imported triton library."""
    global _JITTED
    if _JITTED:
        return
    if _interpreting():
        from triton.runtime.interpreter import InterpretedFunction as jit  # what triton.jit returns then
    else:
        jit = triton.jit
    for name in ("_load_tile", "_store_tile", "_score_tile", "_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        globals()[name] = jit(globals()[name])
    if not _interpreting():
        for name, tiles in _TILES.items():
            configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]
            prune = {"early_config_prune": _prune_wide_heads}
            _AUTOTUNED[name] = triton.autotune(configs, key=_TUNE_KEY, prune_configs_by=prune)(globals()[name])
    _JITTED = True


# Configurations that triton.autotune tries on CUDA, (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel,
# after the FlashAttention-2 Triton kernels (Triton's fused-attention tutorial): the forward keeps a long
# query tile and walks short key tiles; dK/dV keep a long key tile (their two accumulators) and walk short
# query tiles; dQ the reverse. Tiles of 128 x 128 take 8 warps. The last entry of each list is small
# enough for head dims up to 256 (see _prune_wide_heads). Each entry costs one compilation per shape
# class and one timing per key, so the lists stay short.
_TILES = {
    "_fwd_kernel": [
        (128, 128, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 4, 3),
        (128, 64, 4, 4),
        (64, 64, 4, 3),
        (64, 32, 4, 2),
    ],
    "_bwd_dq_kernel": [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2)],
    "_bwd_dkdv_kernel": [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2)],
}
_TUNE_KEY = ["L", "S", "D", "Dv", "GROUPS", "MASK_KIND", "IS_CAUSAL"]  # triton adds the tensors' dtypes


def _prune_wide_heads(configs, named_args, **kwargs):
    """Head dims over 128: only tiles of at most 64 x 32 (accumulators 256 columns wide fill the registers,
    and larger tiles the shared memory)."""
    if max(named_args["D"], named_args["Dv"]) <= 128:
        return configs
    return [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32]


# --------------------------------------------------------------------------------------------------
# Kernels. q, k, v, out, dout are contiguous (B, H|Hkv, L|S, D|Dv); lse2 and delta are (B, H, L).
# --------------------------------------------------------------------------------------------------
def _load_tile(ptr, first_row, rows, n_rows, dims, n_dims):
    """Rows ``first_row + rows`` (those < n_rows) of a row-major matrix with n_dims columns; 0-padded."""
    mask = (rows[:, None] < n_rows) & (dims[None, :] < n_dims)
    offsets = (first_row + rows[:, None]).to(tl.int64) * n_dims + dims[None, :]  # int64: no overflow
    return tl.load(ptr + offsets, mask=mask, other=0.0)


def _store_tile(ptr, x, first_row, rows, n_rows, dims, n_dims):
    mask = (rows[:, None] < n_rows) & (dims[None, :] < n_dims)
    offsets = (first_row + rows[:, None]).to(tl.int64) * n_dims + dims[None, :]
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=mask)


def _score_tile(
    q,
    k,
    rows,
    cols,
    b,
    h,
    Mask,
    smb,
    smh,
    sml,
    sms,
    L,
    S,
    qk_scale,
    MASK_KIND: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``z = log2(e) * (q k^T * scale + mask)`` for a (BLOCK_M, BLOCK_N) tile; forbidden -> -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    allowed = (rows[:, None] < L) & (cols[None, :] < S)
    if IS_CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    if MASK_KIND != 0:
        row_offsets = b.to(tl.int64) * smb + h.to(tl.int64) * smh + rows[:, None].to(tl.int64) * sml
        offsets = row_offsets + cols[None, :].to(tl.int64) * sms  # zero strides broadcast, no copies
        mask = tl.load(Mask + offsets, mask=allowed, other=0)
        if MASK_KIND == 1:
            allowed = allowed & (mask != 0)
        else:
            s = s + mask.to(tl.float32) * 1.4426950408889634  # log2(e)
    return tl.where(allowed, s, -float("inf"))


def _fwd_kernel(
    Q,
    K,
    V,
    Mask,
    Out,
    Lse,
    smb,
    smh,
    sml,
    sms,
    H,
    L,
    S,
    D,
    Dv,
    qk_scale,
    GROUPS: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: BLOCK_M query rows of head h, online softmax over the key tiles."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)  # query tile; b * H + h
    b, h = bh // H, bh % H
    bhk = b * (H // GROUPS) + h // GROUPS  # the key/value head of query head h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, vdims, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    q = _load_tile(Q, bh * L, rows, L, dims, D)  # (BLOCK_M, BLOCK_D)
    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = S
    if IS_CAUSAL:  # keys j <= i < (pid_m + 1) * BLOCK_M; the last tile walked may cross it (masked in it),
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)  # so any BLOCK_N works with any BLOCK_M
    for j0 in range(0, hi, BLOCK_N):
        cols = j0 + offs_n
        k = _load_tile(K, bhk * S, cols, S, dims, D)  # (BLOCK_N, BLOCK_D)
        z = _score_tile(
            q, k, rows, cols, b, h, Mask, smb, smh, sml, sms, L, S, qk_scale, MASK_KIND, IS_CAUSAL, PRECISION
        )
        m_new = tl.maximum(m, tl.max(z, 1))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.exp2(z - m_use[:, None])
        alpha = tl.exp2(m - m_use)  # rescale of the old state: 2^(m - m')
        l = l * alpha + tl.sum(p, 1)
        v = _load_tile(V, bhk * S, cols, S, vdims, Dv)  # (BLOCK_N, BLOCK_DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    seen = l > 0
    _store_tile(Out, acc / tl.where(seen, l, 1.0)[:, None], bh * L, rows, L, vdims, Dv)
    lse2 = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("inf"))  # +inf: P = 0 in the backward
    tl.store(Lse + bh * L + rows, lse2, mask=rows < L)


def _bwd_dq_kernel(
    Q,
    K,
    V,
    Mask,
    GradOut,
    Lse,
    Delta,
    GradQ,
    smb,
    smh,
    sml,
    sms,
    H,
    L,
    S,
    D,
    Dv,
    qk_scale,
    sm_scale,
    GROUPS: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dQ_i = scale * sum_j dZ_ij K_j  with  dZ = P * (dO V^T - delta),  P = 2^(z - lse2)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    bhk = b * (H // GROUPS) + h // GROUPS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, vdims, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    q = _load_tile(Q, bh * L, rows, L, dims, D)
    do = _load_tile(GradOut, bh * L, rows, L, vdims, Dv)
    lse = tl.load(Lse + bh * L + rows, mask=rows < L, other=float("inf"))  # +inf: P = 0
    delta = tl.load(Delta + bh * L + rows, mask=rows < L, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S
    if IS_CAUSAL:
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
    for j0 in range(0, hi, BLOCK_N):
        cols = j0 + offs_n
        k = _load_tile(K, bhk * S, cols, S, dims, D)
        v = _load_tile(V, bhk * S, cols, S, vdims, Dv)
        z = _score_tile(
            q, k, rows, cols, b, h, Mask, smb, smh, sml, sms, L, S, qk_scale, MASK_KIND, IS_CAUSAL, PRECISION
        )
        p = tl.exp2(z - lse[:, None])
        dz = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        dq += tl.dot(dz.to(k.dtype), k, input_precision=PRECISION)
    _store_tile(GradQ, dq * sm_scale, bh * L, rows, L, dims, D)


def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    Mask,
    GradOut,
    Lse,
    Delta,
    GradK,
    GradV,
    smb,
    smh,
    sml,
    sms,
    H,
    L,
    S,
    D,
    Dv,
    qk_scale,
    sm_scale,
    GROUPS: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dV_j = sum_i P_ij^T dO_i,  dK_j = scale * sum_i dZ_ij^T Q_i, over the G heads sharing head hk."""
    pid_n, bhk = tl.program_id(0), tl.program_id(1)  # key tile; b * Hkv + hk
    b, hk = bhk // (H // GROUPS), bhk % (H // GROUPS)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims, vdims, offs_m = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_M)
    k = _load_tile(K, bhk * S, cols, S, dims, D)
    v = _load_tile(V, bhk * S, cols, S, vdims, Dv)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = 0
    if IS_CAUSAL:  # rows i >= j >= pid_n * BLOCK_N: start at the query tile holding that row (any BLOCK_M)
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(GROUPS):
        h = hk * GROUPS + g
        bh = b * H + h
        for i0 in range(lo, L, BLOCK_M):
            rows = i0 + offs_m
            q = _load_tile(Q, bh * L, rows, L, dims, D)
            do = _load_tile(GradOut, bh * L, rows, L, vdims, Dv)
            lse = tl.load(Lse + bh * L + rows, mask=rows < L, other=float("inf"))
            delta = tl.load(Delta + bh * L + rows, mask=rows < L, other=0.0)
            z = _score_tile(
                q, k, rows, cols, b, h, Mask, smb, smh, sml, sms, L, S, qk_scale, MASK_KIND, IS_CAUSAL, PRECISION
            )
            p = tl.exp2(z - lse[:, None])  # (BLOCK_M, BLOCK_N); 0 where forbidden or the row is empty
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dz = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
            dk += tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision=PRECISION)
    _store_tile(GradK, dk * sm_scale, bhk * S, cols, S, dims, D)
    _store_tile(GradV, dv, bhk * S, cols, S, vdims, Dv)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
def _unsupported(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None) -> str | None:
    """Why these inputs cannot run on the Triton kernel, or None if they can."""
    if not _load():
        return "triton is not installed (pip install 'tformer[triton]')"
    if query.device.type == "cpu" and not _interpreting():
        return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
    if query.device.type not in ("cuda", "cpu"):
        return f"device {query.device.type} is not supported"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype} is not supported (float16, bfloat16, float32)"
    if not (query.dtype == key.dtype == value.dtype):
        return "query, key and value must share one dtype"
    if not all(2 <= t.dim() <= 4 for t in (query, key, value)):
        return "query, key, value must have 2 to 4 dims"
    q, k, v = (_as_4d(t) for t in (query, key, value))
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return "batch sizes must be equal (no batch broadcasting)"
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] != 0:
        return "query heads must be a multiple of key/value heads, and key and value heads equal"
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or max(q.shape[-1], v.shape[-1]) > 256:
        return "head dims must match (query/key) and be at most 256"
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            return f"attn_mask dtype {attn_mask.dtype} is not bool or floating"
        if attn_mask.requires_grad:
            return "a float attn_mask that requires grad is not supported (use the tiled backend)"
        try:
            torch.broadcast_shapes(attn_mask.shape, (*q.shape[:2], q.shape[2], k.shape[2]))
        except RuntimeError:
            return f"attn_mask {tuple(attn_mask.shape)} does not broadcast to (B, H, L, S)"
        if attn_mask.dim() > 4:
            return "attn_mask must have at most 4 dims"
    return None


def triton_supports(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool) -> bool:
    """True when :func:`triton_attention` can run these inputs (any ``is_causal``)."""
    return _unsupported(query, key, value, attn_mask) is None


def _as_4d(t: Tensor) -> Tensor:
    return t.view((1,) * (4 - t.dim()) + tuple(t.shape))


AUTOTUNE_MIN_LENGTH = 256  # shorter queries or keys (decoding steps, short prompts) take fixed tiles


def _blocks(block_size: int | tuple[int, int] | None, q: Tensor, k: Tensor) -> tuple[int, int] | None:
    """(BLOCK_M, BLOCK_N) from ``block_size`` (an int for both, or a pair); 16 x 16 in the interpreter, where
    small tiles run fastest. On CUDA without ``block_size``: None (autotuned tiles) when the query and key
    lengths are both at least ``AUTOTUNE_MIN_LENGTH``, else fixed tiles, so that decoding (one new query,
    a key length that grows every step) never pays for a new tuning run per step."""
    if block_size is None:
        if not q.is_cuda or _interpreting():
            return 16, 16
        if min(q.shape[-2], k.shape[-2]) >= AUTOTUNE_MIN_LENGTH:
            return None
        return (64, 64) if max(q.shape[-1], k.shape[-1]) <= 128 else (32, 32)
    bm, bn = (block_size, block_size) if isinstance(block_size, int) else block_size
    if not all(b >= 16 and b & (b - 1) == 0 for b in (bm, bn)):  # tl.arange: powers of 2; tl.dot: >= 16
        raise ValueError(f"triton_attention: block sizes must be powers of two >= 16; got {block_size}")
    return bm, bn


def _launch_config(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool):
    B, H, L, D = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    if mask is None:
        mask_arg, strides, kind = q, (0, 0, 0, 0), MASK_NONE  # dummy pointer, never read
    else:
        mask_arg = mask.expand(B, H, L, S)  # a view: broadcast dims get stride 0
        strides, kind = mask_arg.stride(), MASK_FLOAT
        if mask.dtype == torch.bool:
            mask_arg, kind = mask_arg.view(torch.uint8), MASK_BOOL
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    meta = dict(GROUPS=H // k.shape[1], MASK_KIND=kind, IS_CAUSAL=is_causal, PRECISION=precision)
    meta.update(BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(Dv)))
    return mask_arg, strides, (H, L, S, D, Dv), meta


def _launch(name: str, programs: tuple[int, str, int], args: tuple, meta: dict, block: tuple[int, int] | None):
    """Run kernel ``name`` with the tiles ``block`` (BLOCK_M, BLOCK_N) or, for ``block=None``, with those its
    autotuner found fastest for these shapes. ``programs = (n, tile, heads)``: one program per tile of n
    positions (query rows if ``tile`` is "BLOCK_M", keys if "BLOCK_N") and per head, so the grid is a
    function of the tiles chosen."""
    n, tile, heads = programs

    def grid(tiles):
        return (triton.cdiv(n, tiles[tile]), heads)

    if block is None:
        _AUTOTUNED[name][grid](*args, **meta)
    else:
        tiles = {"BLOCK_M": block[0], "BLOCK_N": block[1]}
        globals()[name][grid(tiles)](*args, **meta, **tiles)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, block):
        mask_arg, strides, dims, meta = _launch_config(q, k, v, mask, is_causal)
        B, H, L, _ = q.shape
        out = q.new_empty(B, H, L, v.shape[-1])
        lse2 = torch.empty(B, H, L, device=q.device, dtype=torch.float32)
        args = (q, k, v, mask_arg, out, lse2, *strides, *dims, scale * LOG2E)
        _launch("_fwd_kernel", (L, "BLOCK_M", B * H), args, meta, block)
        ctx.save_for_backward(q, k, v, mask, out, lse2)
        ctx.args = (is_causal, scale, block)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, mask, out, lse2 = ctx.saved_tensors
        is_causal, scale, block = ctx.args
        mask_arg, strides, dims, meta = _launch_config(q, k, v, mask, is_causal)
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(dim=-1)  # rowsum(dO * O), (B, H, L)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        B, H, L, _ = q.shape
        inputs, rest = (q, k, v, mask_arg, dout, lse2, delta), (*strides, *dims, scale * LOG2E, scale)
        _launch("_bwd_dq_kernel", (L, "BLOCK_M", B * H), (*inputs, dq, *rest), meta, block)
        _launch("_bwd_dkdv_kernel", (k.shape[2], "BLOCK_N", B * k.shape[1]), (*inputs, dk, dv, *rest), meta, block)
        return dq, dk, dv, None, None, None, None


def triton_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    block_size: int | tuple[int, int] | None = None,
) -> Tensor:
    """``softmax(Q K^T * scale + mask) V`` with Triton FlashAttention-2 kernels; same semantics as
    :func:`tformer.attention.tiled.tiled_attention` on the inputs :func:`triton_supports` accepts.

    query ``(B, H, L, D)``, key ``(B, Hkv, S, D)``, value ``(B, Hkv, S, Dv)`` -> ``(B, H, L, Dv)``
    (2-D and 3-D inputs get leading dims of 1). ``block_size``: query rows and keys per program tile, an
    int for both or ``(query rows, keys)``, powers of two >= 16; default: autotuned on CUDA when L and S are
    both >= ``AUTOTUNE_MIN_LENGTH`` (each kernel times its configurations once per new L, S, head dims,
    groups, mask kind, causality and dtype), else 64 (32 for head dims over 128); 16 in the interpreter.
    Raises NotImplementedError for unsupported inputs.
    """
    reason = _unsupported(query, key, value, attn_mask)
    if reason is not None:
        raise NotImplementedError(f"triton_attention: {reason}")
    _jit_all()
    block = _blocks(block_size, query, key)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out_ndim = max(t.dim() for t in (query, key, value, attn_mask) if t is not None)
    q, k, v = (_as_4d(t).contiguous() for t in (query, key, value))
    out = _TritonAttention.apply(q, k, v, attn_mask, bool(is_causal), scale, block)
    return out.view(out.shape[4 - out_ndim :])
