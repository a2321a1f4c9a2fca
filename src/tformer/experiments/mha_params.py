"""``mha-params``: multi-head attention holds 4 d_model^2 weights whatever the number of heads.

Claim (source, Q2(a)): "Each of W^Q, W^K, W^V maps d_model -> h d_k = d_model, so each is d_model x d_model =
d_model^2 params. W^O maps concatenated h d_v = d_model back to d_model: d_model^2. Total = 4 d_model^2,
independent of h because h d_k = d_model cancels the h dependence."

Measured: the parameters of :class:`tformer.MultiHeadAttention` counted tensor by tensor (on the ``meta``
device: shapes only, no memory), for several d_model and every power-of-two head count up to d_model.

Shapes: C (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tformer.experiments._common import Table, new_figure, save_figure
from tformer.layers import MultiHeadAttention

QUESTION = "Q2(a)"
TITLE = "Parameters of multi-head attention"
CLAIM = (
    "W^Q, W^K, W^V each map d_model -> h d_k = d_model (d_model^2 parameters each), W^O maps h d_v = d_model back "
    "(d_model^2): total 4 d_model^2, independent of h because h d_k = d_model."
)
SIZES: dict[str, dict] = {
    "quick": dict(d_models=(64, 256)),
    "report": dict(d_models=(64, 128, 256, 512, 1024)),
}


@dataclass
class MHAParamsResult:
    """``weights[d][i]`` (bias-free) and ``with_bias[d][i]`` counts for ``heads[d][i]`` heads at d_model ``d``."""

    d_models: list[int]
    heads: dict[int, list[int]]
    weights: dict[int, list[int]]
    with_bias: dict[int, list[int]]
    per_matrix: dict[int, list[dict[str, int]]]  # per head count: weights of W^Q, W^K, W^V, W^O

    def all_equal_4d2(self) -> bool:
        return all(c == 4 * d * d for d in self.d_models for c in self.weights[d])

    def tables(self) -> list[Table]:
        rows = []
        for d in self.d_models:
            sizes = {n for per in self.per_matrix[d] for n in per.values()}
            rows.append(
                (
                    str(d),
                    ", ".join(map(str, self.heads[d])),
                    "/".join(f"{n:,}" for n in sorted(sizes)),
                    "/".join(sorted({f"{c:,}" for c in self.weights[d]})),
                    f"{4 * d * d:,}",
                    "/".join(sorted({f"{c:,}" for c in self.with_bias[d]})),
                )
            )
        columns = (
            "d_model",
            "heads h",
            "each of W^Q, W^K, W^V, W^O",
            "weights (all h)",
            "4 d_model^2",
            "with biases (all h)",
        )
        return [Table(columns, tuple(rows), "Parameters of tformer.MultiHeadAttention")]

    def findings(self) -> list[str]:
        total = sum(len(v) for v in self.heads.values())
        verdict = "every one equals" if self.all_equal_4d2() else "NOT all equal to"
        return [
            f"{total} (d_model, h) pairs counted: {verdict} 4 d_model^2 weights; with biases 4 d_model^2 + 4 d_model",
            "each W^Q, W^K, W^V, W^O is d_model x d_model for every h: the heads split d_model, they do not add to it",
        ]

    def plot(self, out_dir: Path) -> list[Path]:
        fig, axes = new_figure(size=(5.0, 3.6))
        ax = axes[0, 0]
        for d in self.d_models:
            ax.plot(self.heads[d], self.weights[d], "o-", label=f"d_model = {d}")
            ax.axhline(4 * d * d, color="gray", ls=":", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("number of heads h")
        ax.set_ylabel("weights (bias-free)")
        ax.set_title("Q2(a): MultiHeadAttention parameters (dotted: 4 d_model^2)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        return [save_figure(fig, out_dir, "mha-params")]


def count(d_model: int, num_heads: int, bias: bool) -> int:
    """Parameters of ``MultiHeadAttention(d_model, num_heads, bias)``, built on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in MultiHeadAttention(d_model, num_heads, bias=bias).parameters())


def per_matrix(d_model: int, num_heads: int) -> dict[str, int]:
    """Weights of ``W^Q, W^K, W^V`` (the row blocks of the fused input projection) and ``W^O``."""
    with torch.device("meta"):
        mha = MultiHeadAttention(d_model, num_heads, bias=False)
    kv_dim = mha.num_kv_heads * mha.head_dim
    q, k, v = mha.in_proj.weight.split([d_model, kv_dim, kv_dim], dim=0)  # (3C, C) -> three (C, C)
    return {"W^Q": q.numel(), "W^K": k.numel(), "W^V": v.numel(), "W^O": mha.out_proj.weight.numel()}


def run(d_models: Sequence[int] = (64, 256), max_heads: int = 64) -> MHAParamsResult:
    """Count for each ``d_model`` and each power-of-two ``h <= min(d_model, max_heads)``."""
    heads = {d: [h for h in (2**i for i in range(12)) if h <= min(d, max_heads) and d % h == 0] for d in d_models}
    weights = {d: [count(d, h, bias=False) for h in heads[d]] for d in d_models}
    with_bias = {d: [count(d, h, bias=True) for h in heads[d]] for d in d_models}
    return MHAParamsResult(
        list(d_models), heads, weights, with_bias, {d: [per_matrix(d, h) for h in heads[d]] for d in d_models}
    )
