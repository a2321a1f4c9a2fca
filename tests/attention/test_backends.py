"""The attention backends of :mod:`tformer.attention` against PyTorch and NumPy oracles, the CPU half-precision
rule of the SDPA backend, and the registry itself (one table, the config's choices, clear errors)."""

import re
from typing import get_args

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tformer import attention
from tformer import functional as tf
from tformer.attention import CPU_BF16_FLOAT32_MAX_KEYS, scaled_dot_product_attention
from tformer.config import AttnBackend

# float64 reference vs float64 PyTorch: both are exact up to summation order, so 1e-10 is ~1e5 ulps of slack.
F64_TOL = 1e-10


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


CASES = [
    # (batch dims, L, S, E, Ev)
    ((2, 3), 5, 5, 8, 8),
    ((1, 4), 7, 11, 16, 12),  # cross-attention shape, L != S, Ev != E
    ((3,), 13, 4, 6, 5),
    ((), 1, 9, 4, 4),
]


@pytest.mark.parametrize("lead,L,S,E,Ev", CASES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "bool+causal", "padding"])
def test_reference_equals_torch_sdpa(lead, L, S, E, Ev, mask_kind):
    q, k, v = _rand(*lead, L, E, seed=1), _rand(*lead, S, E, seed=2), _rand(*lead, S, Ev, seed=3)
    mask, causal = None, False
    if mask_kind in ("bool", "bool+causal"):
        mask = torch.rand(L, S, generator=torch.Generator().manual_seed(4)) > 0.3
    elif mask_kind == "float":
        mask = _rand(L, S, seed=5)
    elif mask_kind == "padding" and lead:
        mask = torch.ones(*lead[:1], *([1] * (len(lead) - 1)), 1, S, dtype=torch.bool)
        mask[..., S // 2 :] = False
    if "causal" in mask_kind:
        causal = True
    ours = scaled_dot_product_attention(q, k, v, mask, causal, backend="reference")
    if causal and mask is None:
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # PyTorch forbids attn_mask together with is_causal: give it the merged mask
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=tf.merge_masks(mask, causal, L, S))
    assert ours.shape == (*lead, L, Ev)
    torch.testing.assert_close(ours, theirs, rtol=F64_TOL, atol=F64_TOL)
    sdpa = scaled_dot_product_attention(q, k, v, mask, causal, backend="sdpa")
    torch.testing.assert_close(sdpa, theirs, rtol=F64_TOL, atol=F64_TOL)


def test_custom_scale_and_gradients_match_torch():
    q, k, v = (_rand(2, 3, 6, 8, seed=s).requires_grad_() for s in (1, 2, 3))
    out = scaled_dot_product_attention(q, k, v, scale=0.37, is_causal=True, backend="reference")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.37, is_causal=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=F64_TOL, atol=F64_TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=F64_TOL, atol=F64_TOL)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_grouped_query_heads_use_repeat_interleave_convention(backend):
    q, k, v = _rand(2, 6, 5, 8, seed=1), _rand(2, 2, 7, 8, seed=2), _rand(2, 2, 7, 4, seed=3)
    mask = torch.rand(2, 6, 5, 7, generator=torch.Generator().manual_seed(4)) > 0.4
    ours = scaled_dot_product_attention(q, k, v, mask, backend=backend)
    expanded = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask
    )
    torch.testing.assert_close(ours, expanded, rtol=F64_TOL, atol=F64_TOL)
    weights = tf.attention_weights(q, k, mask)
    assert weights.shape == (2, 6, 5, 7)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_fully_masked_rows_give_zeros_and_zero_gradients(backend):
    q, k, v = (_rand(2, 3, 4, 8, seed=s).requires_grad_() for s in (1, 2, 3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False  # query row 2 may attend to nothing
    float_mask = torch.zeros(4, 4, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    for m in (mask, float_mask):
        out = scaled_dot_product_attention(q, k, v, m, backend=backend)
        assert torch.isfinite(out).all()
        assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
        gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in (gq, gk, gv))
        assert torch.equal(gq[..., 2, :], torch.zeros_like(gq[..., 2, :]))
    weights = tf.attention_weights(q, k, mask)
    assert torch.equal(weights[..., 2, :], torch.zeros_like(weights[..., 2, :]))
    torch.testing.assert_close(weights[..., [0, 1, 3], :].sum(-1), torch.ones(2, 3, 3, dtype=torch.float64))


@pytest.mark.parametrize(
    "dtype,S", [(torch.bfloat16, 64), (torch.bfloat16, 256), (torch.float16, 64), (torch.float16, 300)]
)
@pytest.mark.parametrize("autocast", [False, True])
def test_cpu_half_precision_attention_is_float32_rounded_once(dtype, S, autocast):
    """On the CPU, float16 and short bfloat16 attention run in float32 (PyTorch's half-precision CPU kernel is
    slower there; BENCHMARKS.md): output and gradients are the float32 computation rounded once to the input dtype,
    bit for bit, also inside a bfloat16 autocast region (which would otherwise cast the inputs back down)."""
    q, k, v = (_rand(2, 3, S, 16, seed=s, dtype=torch.float32).to(dtype).requires_grad_() for s in (1, 2, 3))
    mask = _rand(S, S, seed=4, dtype=torch.float32).to(dtype)  # a float mask is cast to float32 with them
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = scaled_dot_product_attention(q, k, v, mask, is_causal=True, backend="sdpa")
    expected = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=tf.merge_masks(mask.float(), True, S, S)
    ).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out, expected)
    g = _rand(2, 3, S, 16, seed=5, dtype=torch.float32).to(dtype)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        assert torch.equal(ours, theirs)


def test_cpu_bfloat16_attention_float32_path_is_at_least_as_accurate():
    """Against a float64 oracle the float32 path, which rounds once, is more accurate on average than PyTorch's
    native bfloat16 kernel, which also rounds the probabilities (max errors tie: both inherit the inputs' rounding)."""
    q, k, v = (_rand(2, 4, 64, 32, seed=s) for s in (1, 2, 3))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    ours = scaled_dot_product_attention(q16, k16, v16, is_causal=True, backend="sdpa")
    native = F.scaled_dot_product_attention(q16, k16, v16, is_causal=True)
    ours_err, native_err = (ours.double() - exact).abs(), (native.double() - exact).abs()
    assert ours_err.max() <= native_err.max()
    assert ours_err.mean() < native_err.mean()


def test_cpu_long_bfloat16_attention_keeps_the_native_kernel():
    """Above CPU_BF16_FLOAT32_MAX_KEYS keys PyTorch's bfloat16 kernel is the faster one, and it is used as is."""
    S, L = CPU_BF16_FLOAT32_MAX_KEYS + 1, 8
    q, k, v = (_rand(1, 2, n, 16, seed=s, dtype=torch.float32).bfloat16() for s, n in ((1, L), (2, S), (3, S)))
    out = scaled_dot_product_attention(q, k, v, backend="sdpa")
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


def _numpy_causal_self_attention(X, Wq, Wk, Wv, dk):
    """The source document's Question 3(a), in NumPy."""
    Q, K, V = X @ Wq, X @ Wk, X @ Wv
    scores = (Q @ K.T) / np.sqrt(dk)
    n = X.shape[0]
    mask = np.triu(np.ones((n, n)), k=1).astype(bool)
    scores[mask] = -np.inf
    scores = scores - scores.max(axis=-1, keepdims=True)
    A = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)
    return A @ V


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_numpy_oracle_of_causal_self_attention(backend):
    rng = np.random.default_rng(0)
    n, d, dk = 9, 12, 6
    X, Wq, Wk, Wv = rng.normal(size=(n, d)), *(rng.normal(size=(d, dk)) for _ in range(3))
    expected = _numpy_causal_self_attention(X, Wq, Wk, Wv, dk)
    Xt = torch.from_numpy(X)
    out = scaled_dot_product_attention(
        Xt @ torch.from_numpy(Wq),
        Xt @ torch.from_numpy(Wk),
        Xt @ torch.from_numpy(Wv),
        is_causal=True,
        backend=backend,
    )
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_bad_inputs_raise_clear_errors():
    q = _rand(2, 4, 8)
    with pytest.raises(ValueError, match="last"):
        scaled_dot_product_attention(q, _rand(2, 4, 6), _rand(2, 4, 6))
    with pytest.raises(ValueError, match="same length"):
        scaled_dot_product_attention(q, _rand(2, 4, 8), _rand(2, 5, 8))
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        scaled_dot_product_attention(q, q, q, backend="fast")
    with pytest.raises(ValueError, match="multiple"):
        scaled_dot_product_attention(_rand(1, 6, 4, 8), _rand(1, 4, 4, 8), _rand(1, 4, 4, 8))
    with pytest.raises(ValueError, match="dtype"):
        scaled_dot_product_attention(q, q.float(), q)
    with pytest.raises(ValueError, match="attn_mask"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="same number of heads"):
        scaled_dot_product_attention(_rand(1, 2, 4, 8), _rand(1, 1, 4, 8), _rand(1, 2, 4, 8))
    with pytest.raises(ValueError, match="D=0"):
        scaled_dot_product_attention(q[..., :0], q[..., :0], q)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("shape", [(4, 3), (3, 4), (4,), (), (3, 1, 4, 4), (2, 3, 4, 4)])
def test_a_mask_that_does_not_fit_the_scores_is_named_with_the_shapes(backend, shape):
    q = _rand(2, 2, 4, 8)  # scores (2, 2, 4, 4): a (4, 3) mask would broadcast nowhere, a (3, 1, 4, 4) one neither
    with pytest.raises(ValueError, match=rf"attn_mask of shape {re.escape(str(shape))} does not broadcast .*L=4, S=4"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(shape, dtype=torch.bool), backend=backend)


def test_the_oracle_refuses_an_integer_mask_instead_of_adding_it():
    """``reference_attention`` and ``attention_scores`` are called directly (the oracle): a 0/1 integer mask added
    to the scores would shift them by one, not forbid a key."""
    q = _rand(1, 4, 8)
    ones = torch.tril(torch.ones(4, 4, dtype=torch.long))
    for fn in (tf.reference_attention, lambda q, k, v, attn_mask: tf.attention_scores(q, k, attn_mask)):
        with pytest.raises(ValueError, match=r"got dtype torch.int64 \(an integer 0/1 mask: pass mask.bool\(\)\)"):
            fn(q, q, q, attn_mask=ones)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_backends_agree_at_the_edges(backend):
    """A float mask of another dtype is cast to the scores' (float64 mask on float32, float32 on bfloat16), and an
    empty query or key length gives the empty result or rows of zeros (no key to attend), on every backend."""
    q = _rand(2, 2, 5, 8, dtype=torch.float32)
    bias = _rand(5, 5)  # float64
    expected = tf.reference_attention(q.double(), q.double(), q.double(), attn_mask=bias)
    out = scaled_dot_product_attention(q, q, q, attn_mask=bias, backend=backend)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)  # float32 rounding of O(1) values
    half = q.bfloat16()
    low = scaled_dot_product_attention(half, half, half, attn_mask=bias.float(), backend=backend)
    assert low.dtype == torch.bfloat16 and (low.double() - expected).abs().max() < 0.05  # bfloat16: 8 bits
    assert scaled_dot_product_attention(q[..., :0, :], q, q, backend=backend).shape == (2, 2, 0, 8)
    no_keys = scaled_dot_product_attention(q, q[..., :0, :], q[..., :0, :], backend=backend)
    assert no_keys.shape == (2, 2, 5, 8) and not no_keys.any()


def test_the_config_offers_exactly_the_built_in_backends():
    assert get_args(AttnBackend) == attention.BACKEND_NAMES == ("auto", *(b.name for b in attention.BUILTIN))
    assert all(name == backend.name for name, backend in attention.BACKENDS.items())
    assert set(attention.BACKEND_NAMES[1:]) <= set(attention.BACKENDS)
    assert attention.resolve("auto") is attention.BACKENDS[attention.auto_backend()]


def test_a_registered_backend_is_resolved_by_name_and_a_taken_name_is_refused():
    backend = attention.Backend("test-only", attention.sdpa_attention, dropout=True)
    try:
        assert attention.register(backend) is backend and attention.register(backend) is backend
        assert attention.resolve("test-only") is backend
        with pytest.raises(ValueError, match="'sdpa' exists already"):
            attention.register(attention.Backend("sdpa", attention.sdpa_attention, dropout=True))
        with pytest.raises(ValueError, match="'auto' exists already"):
            attention.register(attention.Backend("auto", attention.sdpa_attention, dropout=True))
    finally:
        attention.BACKENDS.pop("test-only", None)


@pytest.mark.parametrize("name", ["tiled", "triton"])
def test_backends_without_dropout_refuse_it_by_name(name):
    q = _rand(1, 2, 4, 8)
    with pytest.raises(ValueError, match=rf"backend '{name}' does not implement attention dropout \(dropout_p=0.1\)"):
        scaled_dot_product_attention(q, q, q, dropout_p=0.1, backend=name)
