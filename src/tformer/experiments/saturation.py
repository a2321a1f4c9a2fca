"""``saturation``: large logits saturate the softmax, its Jacobian goes to 0, and so does the gradient.

Claim (source, Q1(b)): "da_i/dz_j = a_i(delta_ij - a_j). Without scaling, Var(s) = d_k grows, so softmax inputs
become large in magnitude -> softmax saturates -> one a_i -> 1, others -> 0. Then a_i(1-a_i) -> 0 and
a_i a_j -> 0, so the whole Jacobian -> 0: vanishing gradients. Scaling by 1/sqrt(d_k) keeps logits O(1),
keeping the softmax in its non-saturated regime."

Measured, two ways:
1. Logits ``Z = Q K^T * scale`` of N(0, 1) queries/keys, with the scale swept so the logit standard deviation
   ``sigma`` runs from 0.1 to over 100: the Frobenius norm of :func:`tformer.functional.softmax_jacobian` per row,
   and the norm of the gradient ``dL/dZ`` that reaches the logits when ``L = <A V, G>`` for a random ``G``.
2. An untrained :class:`tformer.MultiHeadAttention` (PyTorch's default init) on N(0, 1) inputs (the scale
   after a LayerNorm): the entropy of its attention rows with the layer's ``1/sqrt(d_k)`` and without it
   (``scale=1.0``), as ``d_k`` grows. Uniform attention over T keys has entropy ``log T``; saturated, 0.

Shapes: B, T, L, S, C, H, D, Dv (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tformer.experiments._common import (
    Table,
    entropy,
    fmt,
    layer_attention_probs,
    layer_queries_keys,
    new_figure,
    save_figure,
)
from tformer.functional import attention_scores, masked_softmax, softmax_jacobian
from tformer.layers import MultiHeadAttention

QUESTION = "Q1(b)"
TITLE = "Softmax saturation and vanishing gradients"
CLAIM = (
    "da_i/dz_j = a_i(delta_ij - a_j). Without scaling Var(s) = d_k grows, the softmax saturates (one a_i -> 1, "
    "the others -> 0), so the whole Jacobian -> 0: vanishing gradients. Scaling by 1/sqrt(d_k) keeps the "
    "logits O(1) and the Jacobian well away from zero."
)
SIZES: dict[str, dict] = {
    "quick": dict(sigmas=(0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0), dims=(4, 16, 64, 256), num_rows=64, seq_len=32),
    "report": dict(
        sigmas=(0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0),
        dims=(4, 8, 16, 32, 64, 128, 256, 512, 1024),
        num_rows=256,
        seq_len=64,
    ),
}
SWEEP_HEAD_DIM = 64  # d_k of the logit-scale sweep; unscaled logits of N(0, 1) q, k then have sigma = 8


@dataclass
class SaturationResult:
    """Part 1 per ``sigmas[i]`` (target logit std); part 2 per head dimension ``dims[i]``."""

    sigmas: list[float]
    measured_sigmas: list[float]
    jacobian_norm: list[float]  # mean over rows of ||J||_F
    logit_grad_norm: list[float]  # mean over rows of ||dL/dZ||
    max_prob: list[float]  # mean over rows of max_j a_j
    dims: list[int]
    num_heads: int
    seq_len: int
    entropy_scaled: list[float]  # mean row entropy (nats) of the layer with 1/sqrt(d_k)
    entropy_unscaled: list[float]  # ... with scale 1
    logit_std_unscaled: list[float]  # std of the layer's unscaled logits
    jacobian_scaled: list[float]  # mean ||J||_F of the layer's rows, scaled
    jacobian_unscaled: list[float]

    @property
    def max_entropy(self) -> float:
        return math.log(self.seq_len)

    def tables(self) -> list[Table]:
        sweep = tuple(
            (fmt(s), fmt(m), fmt(p), fmt(j), fmt(g))
            for s, m, p, j, g in zip(
                self.sigmas, self.measured_sigmas, self.max_prob, self.jacobian_norm, self.logit_grad_norm, strict=True
            )
        )
        layer = tuple(
            (str(d), fmt(s), fmt(hs), fmt(hu), fmt(js), fmt(ju))
            for d, s, hs, hu, js, ju in zip(
                self.dims,
                self.logit_std_unscaled,
                self.entropy_scaled,
                self.entropy_unscaled,
                self.jacobian_scaled,
                self.jacobian_unscaled,
                strict=True,
            )
        )
        return [
            Table(
                ("logit std (target)", "logit std (measured)", "mean max a_i", "mean ‖J‖_F", "mean ‖dL/dZ‖"),
                sweep,
                f"Softmax Jacobian and logit gradient vs logit scale (d_k = {SWEEP_HEAD_DIM})",
            ),
            Table(
                (
                    "d_k",
                    "unscaled logit std",
                    "entropy, 1/sqrt(d_k)",
                    "entropy, unscaled",
                    "‖J‖, 1/sqrt(d_k)",
                    "‖J‖, unscaled",
                ),
                layer,
                f"Untrained MultiHeadAttention ({self.num_heads} heads, T = {self.seq_len}, "
                f"max entropy log T = {self.max_entropy:.3f} nats)",
            ),
        ]

    def findings(self) -> list[str]:
        i1 = min(range(len(self.sigmas)), key=lambda i: abs(self.sigmas[i] - 1.0))
        peak = max(range(len(self.sigmas)), key=lambda i: self.jacobian_norm[i])
        last = len(self.sigmas) - 1
        uniform = math.sqrt(self.seq_len - 1) / self.seq_len  # ||J||_F of a uniform softmax over T keys
        lines = [
            f"softmax Jacobian norm (d_k = {SWEEP_HEAD_DIM}, T = {self.seq_len} keys): {fmt(self.jacobian_norm[i1])} "
            f"at logit std {fmt(self.sigmas[i1])} (the 1/sqrt(d_k) regime), peak {fmt(self.jacobian_norm[peak])} at "
            f"std {fmt(self.sigmas[peak])}, then falling to {fmt(self.jacobian_norm[last])} at std "
            f"{fmt(self.sigmas[last])} where the largest weight averages {fmt(self.max_prob[last])} (saturated); "
            f"the gradient reaching the logits falls alike, {fmt(self.logit_grad_norm[i1])} -> "
            f"{fmt(self.logit_grad_norm[last])}",
            f"untrained MultiHeadAttention at d_k = {self.dims[-1]}: entropy {fmt(self.entropy_scaled[-1])} nats "
            f"with 1/sqrt(d_k) (uniform: {fmt(self.max_entropy)}) vs {fmt(self.entropy_unscaled[-1])} without "
            f"(unscaled logit std {fmt(self.logit_std_unscaled[-1])}: PyTorch's default Linear init gives q, k "
            f"entries of variance 1/3, so std ~ sqrt(d_k)/3); Jacobian norm {fmt(self.jacobian_scaled[-1])} vs "
            f"{fmt(self.jacobian_unscaled[-1])}{self._unscaled_reading(i1, peak)}",
        ]
        if peak > 0:
            lines.insert(
                1,
                f"not monotone: near-uniform attention (tiny logits) also has a small Jacobian, ‖J‖_F -> sqrt(T-1)/T "
                f"= {fmt(uniform)}; the claim's 'Jacobian -> 0' is the large-logit end",
            )
        return lines

    def _unscaled_reading(self, i1: int, peak: int) -> str:
        """Whether the untrained layer's unscaled Jacobian is the smaller, as the claim has it; where it is not, how
        far its logit scale is from the sweep's saturation (the std past the peak where the norm falls below its
        value at std 1)."""
        if self.jacobian_unscaled[-1] < self.jacobian_scaled[-1]:
            return ": unscaled, the smaller, as the claim says"
        below = [s for i, s in enumerate(self.sigmas) if i > peak and self.jacobian_norm[i] < self.jacobian_norm[i1]]
        where = f"only past std {fmt(below[0])}" if below else "nowhere in the sweep"
        return (
            f": unscaled, not the smaller, against the claim at this size: logit std "
            f"{fmt(self.logit_std_unscaled[-1])} is past the Jacobian's peak but short of saturation (the sweep's "
            f"norm falls below its std-1 value {where})"
        )

    def plot(self, out_dir: Path) -> list[Path]:
        fig, axes = new_figure(ncols=3, size=(4.0, 3.4))
        ax = axes[0, 0]
        ax.loglog(self.sigmas, self.jacobian_norm, "o-", label="mean ||J||_F")
        ax.loglog(self.sigmas, self.logit_grad_norm, "s-", label="mean ||dL/dZ||")
        ax.axvline(1.0, color="gray", ls="--", lw=0.8)
        for d_k in (SWEEP_HEAD_DIM, 1024):
            ax.axvline(math.sqrt(d_k), color="red", ls=":", lw=0.8)
            ax.text(math.sqrt(d_k) * 1.05, ax.get_ylim()[0] * 1.3, f"raw\nd_k={d_k}", fontsize=6, color="red")
        ax.text(1.05, ax.get_ylim()[0] * 1.3, "1/sqrt(d_k)", fontsize=6, color="gray")
        ax.set_xlabel("logit standard deviation")
        ax.set_title("Q1(b): Jacobian and gradient vs logit scale", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax = axes[0, 1]
        ax.semilogx(self.dims, self.entropy_scaled, "o-", label="scale 1/sqrt(d_k)")
        ax.semilogx(self.dims, self.entropy_unscaled, "s-", label="scale 1 (unscaled)")
        ax.axhline(self.max_entropy, color="gray", ls="--", lw=0.8, label="log T (uniform)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_k")
        ax.set_ylabel("attention entropy (nats)")
        ax.set_title("untrained MultiHeadAttention", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        ax = axes[0, 2]
        ax.loglog(self.dims, self.jacobian_scaled, "o-", label="scale 1/sqrt(d_k)")
        ax.loglog(self.dims, self.jacobian_unscaled, "s-", label="scale 1 (unscaled)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_k")
        ax.set_ylabel("mean ||J||_F per row")
        ax.set_title("softmax Jacobian of the layer", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        return [save_figure(fig, out_dir, "saturation")]


def _logit_sweep(
    sigmas: Sequence[float], num_rows: int, num_keys: int, gen: torch.Generator
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Measured logit std, mean ||J||_F, mean ||dL/dZ|| and mean max weight for each target logit std."""
    d = SWEEP_HEAD_DIM
    q = torch.randn(num_rows, d, generator=gen, dtype=torch.float64)  # (L, D)
    k = torch.randn(num_keys, d, generator=gen, dtype=torch.float64)  # (S, D)
    v = torch.randn(num_keys, d, generator=gen, dtype=torch.float64)  # (S, Dv)
    upstream = torch.randn(num_rows, d, generator=gen, dtype=torch.float64)  # dL/d(out), (L, Dv)
    measured, jac, grad, top = [], [], [], []
    for sigma in sigmas:
        z = attention_scores(q, k, scale=sigma / math.sqrt(d)).requires_grad_()  # (L, S), std ~ sigma
        a = masked_softmax(z)  # (L, S)
        ((a @ v) * upstream).sum().backward()  # L = <A V, G>
        measured.append(float(z.detach().std()))
        jac.append(float(torch.linalg.matrix_norm(softmax_jacobian(a.detach())).mean()))  # (L, S, S) -> (L,)
        grad.append(float(z.grad.norm(dim=-1).mean()))
        top.append(float(a.detach().max(dim=-1).values.mean()))
    return measured, jac, grad, top


def run(
    sigmas: Sequence[float] = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0),
    dims: Sequence[int] = (4, 16, 64, 256),
    num_rows: int = 64,
    seq_len: int = 32,
    num_heads: int = 2,
    batch: int = 4,
    seed: int = 0,
) -> SaturationResult:
    """Part 1: sweep the logit scale at ``d_k = 64``; part 2: an untrained MHA layer for each ``d_k`` in ``dims``."""
    gen = torch.Generator().manual_seed(seed)
    measured, jac, grad, top = _logit_sweep(sigmas, num_rows, seq_len, gen)
    torch.manual_seed(seed)
    ent_s, ent_u, std_u, jac_s, jac_u = [], [], [], [], []
    for d in dims:
        mha = MultiHeadAttention(num_heads * d, num_heads).double()
        x = torch.randn(batch, seq_len, num_heads * d, generator=gen, dtype=torch.float64)  # (B, T, C)
        scaled = layer_attention_probs(mha, x)  # (B, H, T, T), the layer's own 1/sqrt(d_k)
        unscaled = layer_attention_probs(mha, x, scale=1.0)
        ent_s.append(float(entropy(scaled).mean()))
        ent_u.append(float(entropy(unscaled).mean()))
        std_u.append(float(attention_scores(*layer_queries_keys(mha, x), scale=1.0).std()))  # (B, H, T, T)
        jac_s.append(float(torch.linalg.matrix_norm(softmax_jacobian(scaled)).mean()))  # (B, H, T, T, T) -> mean
        jac_u.append(float(torch.linalg.matrix_norm(softmax_jacobian(unscaled)).mean()))
    return SaturationResult(
        list(sigmas), measured, jac, grad, top, list(dims), num_heads, seq_len, ent_s, ent_u, std_u, jac_s, jac_u
    )
