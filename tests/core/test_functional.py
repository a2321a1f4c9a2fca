"""tformer.functional against the statements of the source document and against PyTorch."""

import math

import pytest
import torch

from tformer import functional as tf

# float64 reference vs float64 PyTorch: both are exact up to summation order, so 1e-10 is ~1e5 ulps of slack.
F64_TOL = 1e-10


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


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


def test_position_helpers_refuse_sizes_and_types_that_would_give_garbage():
    """A base <= 0 gave NaN columns, an integer tensor rotated to zeros, a numpy offset an AttributeError."""
    with pytest.raises(ValueError, match="base must be positive"):
        tf.sinusoidal_positional_encoding(3, 4, base=0)
    with pytest.raises(ValueError, match="base must be positive"):
        tf.apply_rotary(_rand(1, 2, 4), 0, base=-1.0)
    with pytest.raises(ValueError, match=r"floating \(\.\.\., T, D\) tensor; got torch.int64"):
        tf.apply_rotary(torch.ones(1, 2, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"got torch.float64 \(8,\)"):
        tf.apply_rotary(_rand(8), 0)
    with pytest.raises(TypeError, match="float"):
        tf.sinusoidal_positional_encoding(5.5, 16)
    with pytest.raises(ValueError, match="num_queries=-1"):
        tf.causal_mask(-1, 3)
    x = _rand(1, 3, 4)
    offset = torch.tensor(2).numpy()[()]  # a numpy integer, as an index from numpy code gives
    torch.testing.assert_close(tf.apply_rotary(x, offset), tf.apply_rotary(x, torch.arange(2, 5)), rtol=0, atol=0)
