"""Tiled (online-softmax, FlashAttention-2) attention against a float64 oracle.

Oracle: ``F.scaled_dot_product_attention`` in float64 on float64 copies, grouped-query heads expanded
with ``repeat_interleave`` and ``is_causal`` merged into the mask. Tolerances:
    * float32: relative error (max |x - ref| / max |ref|) <= 1e-5. Each output is a sum of at most a
      few thousand float32 products (unit roundoff 6e-8); observed errors are ~1e-6, so 1e-5 fails on
      any real bug (a wrong rescale or mask gives errors of order 1) while tolerating rounding. Plus
      an absolute 1e-6: with O(1) inputs a true value of exactly 0 (e.g. dq for a query that sees one
      key) comes out as cancellation noise of order eps = 1e-7.
    * bfloat16 / float16: error <= 2x the error of plain materialized attention in the same dtype
      (the FlashAttention test rule) + one unit roundoff of the dtype times max |ref|: the result must
      be rounded to the dtype once, an error no implementation avoids.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tformer.attention.tiled import tiled_attention
from tformer.experiments.memory import peak_allocated_bytes

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


def close32(x, ref):
    return max_err(x, ref) <= FP32_RTOL * ref.abs().max().item() + FP32_ATOL


def make_inputs(b, h, hkv, l, s, e, ev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, l, e, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, e, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, ev, generator=g).to(dtype)
    return q, k, v


def make_mask(kind, b, h, l, s, seed=1):
    """None, 'bool' (random, full shape), 'float' (random values and -inf), or 'pad' (B, 1, 1, S)."""
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "bool":
        mask = torch.rand(b, h, l, s, generator=g) > 0.3
        mask[..., 0] = True  # keep every row attendable here; empty rows have their own test
        return mask
    if kind == "float":
        mask = torch.randn(b, 1, l, s, generator=g)
        mask[..., 1:][mask[..., 1:] > 1.0] = -math.inf
        return mask
    lengths = torch.randint(1, s + 1, (b,), generator=g)
    return (torch.arange(s) < lengths[:, None]).view(b, 1, 1, s)


def merged_mask(mask, causal, l, s, device="cpu"):
    if not causal:
        return mask
    tril = torch.ones(l, s, dtype=torch.bool, device=device).tril()
    if mask is None:
        return tril
    return mask & tril if mask.dtype == torch.bool else mask.masked_fill(~tril, -math.inf)


def oracle(q, k, v, mask=None, causal=False, scale=None):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = k, v
    if q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        kk, vv = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    mask = merged_mask(mask, causal, q.shape[-2], k.shape[-2])
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale), (q, k, v)


def materialized(q, k, v, mask=None, causal=False):
    """Plain softmax(Q K^T / sqrt(E) + mask) V entirely in the inputs' dtype: the baseline error."""
    if q.shape[-3] != k.shape[-3]:
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
    mask = merged_mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.to(q.dtype)
    return torch.softmax(scores, dim=-1) @ v


def forward_and_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)))


def max_err(x, ref):
    return (x.double() - ref).abs().max().item()


CASES = [  # (B, H, Hkv, L, S, E, Ev, block, mask, causal)
    (1, 2, 2, 1, 1, 8, 8, 1, None, False),
    (2, 2, 2, 1, 7, 8, 8, 16, "pad", True),
    (2, 3, 3, 7, 7, 59, 59, 1, "bool", True),
    (1, 2, 2, 23, 29, 8, 8, (2, 3), None, True),  # query and key tiles cut the diagonal differently
    (2, 4, 4, 97, 97, 59, 59, 16, "float", False),
    (1, 4, 2, 97, 50, 64, 32, 128, None, True),
    (2, 8, 2, 97, 97, 8, 8, 16, "bool", True),
    (1, 2, 1, 7, 1025, 8, 8, (1, 128), "float", False),
    (2, 2, 2, 1025, 1025, 64, 64, 128, "pad", True),
    (1, 2, 2, 1025, 97, 8, 16, 2048, None, False),
    (1, 4, 4, 1025, 1025, 16, 16, None, "pad", False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_matches_float64_oracle(case):
    b, h, hkv, l, s, e, ev, block, mask_kind, causal = case
    q, k, v = make_inputs(b, h, hkv, l, s, e, ev, torch.float32)
    mask = make_mask(mask_kind, b, h, l, s)
    ref, leaves = oracle(q, k, v, mask, causal)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    got = forward_and_grads(lambda *a: tiled_attention(*a, mask, causal, block_size=block), q, k, v, dout)
    assert got[0].shape == ref.shape and got[0].dtype == torch.float32
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_grads)):
        assert close32(x, r), name


LOW_PRECISION_CASES = [
    (2, 3, 3, 7, 7, 59, 59, 1, "bool", True),
    (2, 8, 2, 97, 97, 64, 64, 16, "pad", True),
    (1, 2, 2, 1025, 1025, 64, 64, 256, None, False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=str)
def test_low_precision_within_twice_materialized_error(case, dtype):
    b, h, hkv, l, s, e, ev, block, mask_kind, causal = case
    q, k, v = make_inputs(b, h, hkv, l, s, e, ev, dtype)
    mask = make_mask(mask_kind, b, h, l, s)
    ref, leaves = oracle(q, k, v, mask, causal)
    dout = torch.randn_like(ref).to(dtype).double()  # representable in dtype: no input rounding error
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    got = forward_and_grads(lambda *a: tiled_attention(*a, mask, causal, block_size=block), q, k, v, dout)
    base = forward_and_grads(lambda *a: materialized(*a, mask, causal), q, k, v, dout)
    eps = torch.finfo(dtype).eps / 2
    assert got[0].dtype == dtype
    for name, x, y, r in zip(("out", "dq", "dk", "dv"), got, base, (ref, *ref_grads)):
        assert max_err(x, r) <= 2 * max_err(y, r) + eps * r.abs().max().item(), name


def test_float64_stays_float64_and_is_exact():
    q, k, v = make_inputs(1, 2, 2, 37, 41, 16, 16, torch.float64)
    out = tiled_attention(q, k, v, is_causal=True, block_size=8)
    ref, _ = oracle(q, k, v, None, True)
    assert out.dtype == torch.float64
    assert max_err(out, ref) <= 1e-12  # float64 roundoff (1e-16) accumulated over 41 keys


def test_broadcast_two_dim_inputs_and_explicit_scale():
    q, k, v = (t[0, 0] for t in make_inputs(1, 1, 1, 13, 21, 8, 8, torch.float32))
    out = tiled_attention(q, k, v, scale=0.3, block_size=5)
    ref, _ = oracle(q, k, v, scale=0.3)
    assert out.shape == (13, 8)
    assert close32(out, ref)


@pytest.mark.parametrize(
    "mask_kind, causal, shapes",
    [
        ("bool", False, ((1, 4, 5, 3), (1, 2, 6, 3))),
        ("float", True, ((2, 2, 6, 3), (2, 1, 4, 2))),
        (None, True, ((1, 3, 7, 2), (1, 3, 7, 2))),
    ],
)
def test_gradcheck_float64(mask_kind, causal, shapes):
    (b, h, l, e), (_, hkv, s, ev) = shapes
    q, k, v = make_inputs(b, h, hkv, l, s, e, ev, torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = make_mask(mask_kind, b, h, l, s)
    inputs = (q, k, v)
    if mask_kind == "float":
        mask = mask.double().clamp(min=-30).requires_grad_()  # finite: gradcheck perturbs every entry
        inputs = (q, k, v, mask)

    def fn(q, k, v, m=mask):
        return tiled_attention(q, k, v, m, causal, block_size=2)

    assert torch.autograd.gradcheck(fn, inputs)


def extreme_inputs(dtype):
    """Scores ``q.k`` in [-1e4, 1e4] (scale 1). Query row r is ``+-100 e_r``, so its scores are
    ``+-100 k[:, r]``. Row 0 has its maximum (a near-tie, 1e4 and 1e4 - 0.7) in the last key tile, after
    tiles whose scores reach 9990; row 1 has its maximum in the first tile; rows 2, 3 are random."""
    g = torch.Generator().manual_seed(3)
    l, s, e = 4, 100, 8
    q = torch.zeros(1, 1, l, e)
    q[0, 0, torch.arange(l), torch.arange(l)] = torch.tensor([100.0, -100.0, 100.0, -100.0])
    k = 2 * torch.rand(1, 1, s, e, generator=g) - 1
    k[0, 0, :, 0] = 100 * k[0, 0, :, 0].clamp(max=0.999)
    k[0, 0, -2:, 0] = torch.tensor([100.0, 99.993])
    k[0, 0, :, 1:] *= 100
    k[0, 0, 0, 1] = -100.0
    v = torch.randn(1, 1, s, e, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_extreme_logits_no_overflow(dtype):
    q, k, v = extreme_inputs(dtype)
    ref, leaves = oracle(q, k, v, scale=1.0)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    got = forward_and_grads(lambda *a: tiled_attention(*a, scale=1.0, block_size=16), q, k, v, dout)
    base = forward_and_grads(_unit_scale, q, k, v, dout)
    max_score = 1e4
    for name, x, y, r in zip(("out", "dq", "dk", "dv"), got, base, (ref, *ref_grads)):
        assert torch.isfinite(x).all(), name
        # Rounding a score of size 1e4 moves it by ~1e4 * eps, and every weight by that relative amount,
        # in any implementation of this dtype: that is the floor; beyond it, 2x the materialized error.
        floor = torch.finfo(dtype).eps * max_score * r.abs().max().item()
        assert max_err(x, r) <= 2 * max_err(y, r) + floor, name


def _unit_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


@pytest.mark.parametrize("mask_type", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros_and_zero_grads(mask_type, causal):
    b, h, l, s, e = 2, 2, 40, 48, 8
    q, k, v = make_inputs(b, h, h, l, s, e, e, torch.float32)
    allowed = torch.rand(b, h, l, s, generator=torch.Generator().manual_seed(5)) > 0.5
    allowed[..., 0] = True
    empty_rows = [3, 17, 30]
    allowed[:, :, empty_rows] = False  # rows with nothing to attend
    allowed[:, :, :, 16:32] = False  # a whole key tile masked for every query (block 16): skipped
    allowed[:, :, 32:48] = False  # the last query tile entirely masked
    mask = allowed if mask_type == "bool" else torch.zeros(b, h, l, s).masked_fill(~allowed, -math.inf)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out = tiled_attention(q, k, v, mask, causal, block_size=16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    dead = empty_rows + list(range(32, 40))
    assert (out[:, :, dead] == 0).all() and (dq[:, :, dead] == 0).all()
    assert (dk[:, :, 16:32] == 0).all() and (dv[:, :, 16:32] == 0).all()
    ref, _ = oracle(q, k, v, mask, causal)
    assert close32(out, ref)


def peak_extra_bytes(kind: str, n: int) -> int:
    """The allocator's peak of one forward+backward (8 heads, E = 64) beyond the inputs: outputs, gradients and
    every temporary (:func:`tformer.experiments.memory.peak_allocated_bytes`; exact, whatever else runs)."""
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 8, n, 64)
    fn = tiled_attention if kind == "tiled" else materialized
    return peak_allocated_bytes(lambda: fn(q, k, v).backward(dout))


def test_memory_grows_linearly_not_quadratically():
    """At n = 512 and 2048: the quadratic reference holds a few 8 x n x n float32 tensors (8 MiB each at n = 512,
    128 MiB at 2048; measured 26 and 392 MiB): 4x the length gives ~15x the memory. The tiled path holds O(n)
    tensors (its outputs, the gradients, the row statistics) plus fixed tiles (measured 9.0 and 24.1 MiB): < 5x,
    and at n = 2048 less than a quarter of one score matrix."""
    tiled = [peak_extra_bytes("tiled", n) for n in (512, 2048)]
    reference = [peak_extra_bytes("reference", n) for n in (512, 2048)]
    score_matrix = 8 * 2048 * 2048 * 4
    assert tiled[1] < 5 * tiled[0], tiled
    assert reference[1] > 10 * reference[0], reference
    assert tiled[1] < reference[1] / 5, (tiled, reference)
    assert reference[1] >= 2 * score_matrix and tiled[1] < score_matrix / 4, (tiled, reference)
