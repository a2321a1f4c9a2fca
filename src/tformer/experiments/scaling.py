"""``scaling``: the variance of a raw dot product grows as d_k; dividing by sqrt(d_k) keeps it at 1.

Claim (source, Q1(a)): "Sum of d_k independent terms: E[s_ij] = 0, Var(s_ij) = d_k. To restore unit variance
divide by standard deviation sqrt(d_k), not d_k (which would over-shrink to variance 1/d_k)."

Measured: q, k with iid N(0, 1) entries; the logits ``Z = Q K^T * scale`` from
:func:`tformer.functional.attention_scores` with scale ``1``, ``1/sqrt(d_k)`` and ``1/d_k``; the variance
of Z's entries for each d_k, and the slope of ``log Var`` against ``log d_k`` (claimed: 1, 0, -1).

Shapes: L, S, D (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tformer.experiments._common import Table, fit_power_law, fmt, new_figure, save_figure
from tformer.functional import attention_scores

QUESTION = "Q1(a)"
TITLE = "Why the logits are divided by sqrt(d_k)"
CLAIM = (
    "Each term q_im k_jm has mean 0 and variance 1, so Var(s_ij) = d_k. To restore unit variance divide by "
    "the standard deviation sqrt(d_k), not d_k (which would over-shrink to variance 1/d_k)."
)
SIZES: dict[str, dict] = {
    "quick": dict(dims=(4, 16, 64, 256), num_queries=64, num_keys=64),
    "report": dict(dims=(2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), num_queries=128, num_keys=128),
}

# scaling name -> (scale as a function of d_k, claimed slope of log Var against log d_k)
SCALINGS: dict[str, tuple[Callable[[int], float], float]] = {
    "raw (scale 1)": (lambda d: 1.0, 1.0),
    "1/sqrt(d_k)": (lambda d: 1.0 / math.sqrt(d), 0.0),
    "1/d_k": (lambda d: 1.0 / d, -1.0),
}


@dataclass
class ScalingResult:
    """``variances[name][i]``: variance of the logits at ``dims[i]`` under scaling ``name``."""

    dims: list[int]
    variances: dict[str, list[float]]
    slopes: dict[str, float]
    expected_slopes: dict[str, float]
    samples_per_dim: int

    def tables(self) -> list[Table]:
        names = list(self.variances)
        rows = [(str(d), *(fmt(self.variances[n][i]) for n in names)) for i, d in enumerate(self.dims)]
        rows.append(("fitted slope", *(f"{self.slopes[n]:+.3f}" for n in names)))
        rows.append(("claimed slope", *(f"{self.expected_slopes[n]:+.0f}" for n in names)))
        return [Table(("d_k", *(f"Var, {n}" for n in names)), tuple(rows), "Variance of the attention logits")]

    def findings(self) -> list[str]:
        slopes = ", ".join(f"{n}: {self.slopes[n]:+.3f}" for n in self.slopes)
        var_sqrt = self.variances["1/sqrt(d_k)"]
        return [
            f"log-log slopes of Var(logit) against d_k (claimed +1, 0, -1): {slopes}",
            f"with 1/sqrt(d_k) the variance stays in [{min(var_sqrt):.3f}, {max(var_sqrt):.3f}] for d_k from "
            f"{self.dims[0]} to {self.dims[-1]} ({self.samples_per_dim} logits per d_k)",
        ]

    def plot(self, out_dir: Path) -> list[Path]:
        fig, axes = new_figure(size=(5.0, 3.8))
        ax = axes[0, 0]
        for name, values in self.variances.items():
            ax.loglog(self.dims, values, "o-", label=f"{name}: slope {self.slopes[name]:+.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_k")
        ax.set_ylabel("Var(logit)")
        ax.set_title("Q1(a): variance of q.k * scale")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        return [save_figure(fig, out_dir, "scaling")]


def run(
    dims: Sequence[int] = (4, 16, 64, 256),
    num_queries: int = 64,
    num_keys: int = 64,
    seed: int = 0,
) -> ScalingResult:
    """Variance of ``num_queries x num_keys`` logits of iid N(0, 1) queries and keys, per d_k and scaling."""
    if len(dims) < 2 or min(dims) < 1:
        raise ValueError(f"need at least two positive head dimensions; got {dims}")
    gen = torch.Generator().manual_seed(seed)
    variances: dict[str, list[float]] = {name: [] for name in SCALINGS}
    for d in dims:
        q = torch.randn(num_queries, d, generator=gen, dtype=torch.float64)  # (L, D)
        k = torch.randn(num_keys, d, generator=gen, dtype=torch.float64)  # (S, D)
        for name, (scale, _) in SCALINGS.items():
            z = attention_scores(q, k, scale=scale(d))  # (L, S)
            variances[name].append(float(z.var()))
    slopes = {name: fit_power_law(dims, v) for name, v in variances.items()}
    expected = {name: slope for name, (_, slope) in SCALINGS.items()}
    return ScalingResult(list(dims), variances, slopes, expected, num_queries * num_keys)
