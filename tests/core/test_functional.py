"""tformer.functional against the statements of the source document and against PyTorch."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tformer import functional as tf

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
    ours = tf.scaled_dot_product_attention(q, k, v, mask, causal, backend="reference")
    if causal and mask is None:
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # PyTorch forbids attn_mask together with is_causal: give it the merged mask
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=tf.merge_masks(mask, causal, L, S))
    assert ours.shape == (*lead, L, Ev)
    torch.testing.assert_close(ours, theirs, rtol=F64_TOL, atol=F64_TOL)
    sdpa = tf.scaled_dot_product_attention(q, k, v, mask, causal, backend="sdpa")
    torch.testing.assert_close(sdpa, theirs, rtol=F64_TOL, atol=F64_TOL)


def test_custom_scale_and_gradients_match_torch():
    q, k, v = (_rand(2, 3, 6, 8, seed=s).requires_grad_() for s in (1, 2, 3))
    out = tf.scaled_dot_product_attention(q, k, v, scale=0.37, is_causal=True, backend="reference")
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
    ours = tf.scaled_dot_product_attention(q, k, v, mask, backend=backend)
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
        out = tf.scaled_dot_product_attention(q, k, v, m, backend=backend)
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
        out = tf.scaled_dot_product_attention(q, k, v, mask, is_causal=True, backend="sdpa")
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
    ours = tf.scaled_dot_product_attention(q16, k16, v16, is_causal=True, backend="sdpa")
    native = F.scaled_dot_product_attention(q16, k16, v16, is_causal=True)
    ours_err, native_err = (ours.double() - exact).abs(), (native.double() - exact).abs()
    assert ours_err.max() <= native_err.max()
    assert ours_err.mean() < native_err.mean()


def test_cpu_long_bfloat16_attention_keeps_the_native_kernel():
    """Above CPU_BF16_FLOAT32_MAX_KEYS keys PyTorch's bfloat16 kernel is the faster one, and it is used as is."""
    S = tf.CPU_BF16_FLOAT32_MAX_KEYS + 1
    q, k, v = (_rand(1, 2, n, 16, seed=s, dtype=torch.float32).bfloat16() for s, n in ((1, 4), (2, S), (3, S)))
    out = tf.scaled_dot_product_attention(q, k, v, backend="sdpa")
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


def test_masking_after_softmax_is_wrong():
    """Source Q3(a): -inf before the softmax renormalizes; zeroing after leaves rows that do not sum to 1."""
    q, k = _rand(1, 6, 8, seed=1), _rand(1, 6, 8, seed=2)
    before = tf.attention_weights(q, k, is_causal=True)
    torch.testing.assert_close(before.sum(-1), torch.ones(1, 6, dtype=torch.float64))
    assert torch.equal(before.triu(1), torch.zeros_like(before))
    after = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1) * tf.causal_mask(6, 6)  # the wrong variant
    row_sums = after.sum(-1)
    assert (row_sums[0, :-1] < 1 - 1e-6).all()  # every row but the last lost mass to the future
    torch.testing.assert_close(row_sums[0, -1], torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("d_k", [4, 16, 64, 256])
def test_dot_product_variance_grows_with_dk_and_scaling_restores_it(d_k):
    """Source Q1(a): Var(q.k) = d_k; Var(q.k/sqrt(d_k)) = 1; Var(q.k/d_k) = 1/d_k."""
    n = 40_000
    q, k = _rand(n, d_k, seed=d_k), _rand(n, d_k, seed=d_k + 1)
    s = (q * k).sum(-1)
    # The sample variance of n iid draws has relative standard error sqrt(Var(s^2)/Var(s)^2 - 1)/sqrt(n);
    # for a sum of products of normals Var(s^2)/Var(s)^2 - 1 <= 8, so 5 standard errors is 5*sqrt(8/n) ~ 7%.
    rel = 5 * math.sqrt(8 / n)
    assert abs(s.var().item() / d_k - 1) < rel
    assert abs((s / math.sqrt(d_k)).var().item() - 1) < rel
    assert abs((s / d_k).var().item() * d_k - 1) < rel


def test_softmax_jacobian_matches_autograd():
    z = _rand(5, seed=3)
    probs = torch.softmax(z, -1)
    expected = torch.autograd.functional.jacobian(lambda t: torch.softmax(t, -1), z)
    torch.testing.assert_close(tf.softmax_jacobian(probs), expected, rtol=1e-12, atol=1e-14)
    batch = torch.softmax(_rand(3, 4, 6, seed=4), -1)
    J = tf.softmax_jacobian(batch)
    assert J.shape == (3, 4, 6, 6)
    torch.testing.assert_close(J.diagonal(dim1=-2, dim2=-1), batch * (1 - batch))  # a_i (1 - a_i)
    torch.testing.assert_close(J[..., 0, 1], -batch[..., 0] * batch[..., 1])  # -a_i a_j


def test_softmax_jacobian_vanishes_as_logits_saturate():
    """Source Q1(b): scaling the logits up saturates the softmax and the Jacobian goes to 0."""
    z = _rand(16, seed=5)
    norms = [
        torch.linalg.matrix_norm(tf.softmax_jacobian(torch.softmax(c * z, -1))).item() for c in (1, 4, 16, 64, 256)
    ]
    assert all(b < a for a, b in zip(norms[1:], norms[2:]))  # strictly falling once past the O(1) regime
    assert norms[-1] < 1e-12 < norms[0]


def test_sinusoidal_table_layout():
    pe = tf.sinusoidal_positional_encoding(50, 16, dtype=torch.float64)
    pos, i = 7, 3
    omega = 10000.0 ** (-2 * i / 16)
    assert pe.shape == (50, 16)
    assert pe[pos, 2 * i].item() == pytest.approx(math.sin(omega * pos), abs=1e-15)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(omega * pos), abs=1e-15)
    assert tf.sinusoidal_positional_encoding(4, 7).shape == (4, 7)
    with pytest.raises(ValueError, match="d_model"):
        tf.sinusoidal_positional_encoding(4, 0)


def test_sinusoidal_shift_is_a_rotation_independent_of_pos():
    """Source Q2(b): (sin, cos)(pos + k) = M_k (sin, cos)(pos), M_k a rotation by omega_i k."""
    d, n = 32, 120
    pe = tf.sinusoidal_positional_encoding(n, d, dtype=torch.float64)
    omega = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    pairs = pe.view(n, d // 2, 2)  # (pos, i, [sin, cos])
    for k in (1, 5, 37):
        c, s = torch.cos(omega * k), torch.sin(omega * k)
        M = torch.stack([torch.stack([c, s], -1), torch.stack([-s, c], -1)], -2)  # (d/2, 2, 2)
        shifted = torch.einsum("iab,pib->pia", M, pairs[: n - k])
        torch.testing.assert_close(shifted, pairs[k:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_scores_depend_only_on_relative_position(interleaved):
    """Source Q2(c): q_m . k_n after rotation depends only on n - m; rotation preserves norms."""
    D = 16
    q, k = _rand(1, D, seed=1), _rand(1, D, seed=2)

    def score(m, n):
        qm = tf.apply_rotary(q, torch.tensor([m]), interleaved=interleaved)
        kn = tf.apply_rotary(k, torch.tensor([n]), interleaved=interleaved)
        return (qm * kn).sum().item()

    for m, n in [(0, 3), (5, 2), (11, 11), (2, 40)]:
        for shift in (1, 17, 1000):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-10)
    assert score(0, 3) != pytest.approx(score(0, 4), abs=1e-3)  # and it does depend on n - m
    x = _rand(2, 3, 9, D, seed=3)
    rotated = tf.apply_rotary(x, 4, interleaved=interleaved)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(tf.apply_rotary(x, 0, interleaved=interleaved)[..., 0, :], x[..., 0, :])


def test_rope_layouts_are_permutations_of_each_other():
    """Rotate-half on x equals interleaved on the features permuted (x_0, x_{D/2}, x_1, x_{D/2+1}, ...)."""
    D = 8
    x = _rand(5, D, seed=7)
    perm = torch.arange(D).view(2, D // 2).t().reshape(-1)  # [0, 4, 1, 5, 2, 6, 3, 7]
    half = tf.apply_rotary(x, 3, interleaved=False)
    inter = tf.apply_rotary(x[:, perm], 3, interleaved=True)
    torch.testing.assert_close(half[:, perm], inter)
    with pytest.raises(ValueError, match="even"):
        tf.apply_rotary(_rand(2, 5), 0)


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
    out = tf.scaled_dot_product_attention(
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
        tf.scaled_dot_product_attention(q, _rand(2, 4, 6), _rand(2, 4, 6))
    with pytest.raises(ValueError, match="same length"):
        tf.scaled_dot_product_attention(q, _rand(2, 4, 8), _rand(2, 5, 8))
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        tf.scaled_dot_product_attention(q, q, q, backend="fast")
    with pytest.raises(ValueError, match="multiple"):
        tf.scaled_dot_product_attention(_rand(1, 6, 4, 8), _rand(1, 4, 4, 8), _rand(1, 4, 4, 8))
    with pytest.raises(ValueError, match="dtype"):
        tf.scaled_dot_product_attention(q, q.float(), q)
    with pytest.raises(ValueError, match="attn_mask"):
        tf.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.long))
