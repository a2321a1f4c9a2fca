"""``positions``: a shift of the sinusoidal code is a fixed rotation; RoPE scores depend only on n - m.

Claims (source, Q2(b)): "M_k^(i) = [[cos(w_i k), sin(w_i k)], [-sin(w_i k), cos(w_i k)]], independent of pos -- a
rotation by angle w_i k" maps the pair (sin(w_i pos), cos(w_i pos)) to the pair at pos + k, w_i = 10000^(-2i/d).
(Q2(c)): "Score = q^T R(m theta)^T R(n theta) k = q^T R((n-m) theta) k, depending only on n - m."

Measured:
1. On :func:`tformer.functional.sinusoidal_positional_encoding`: ``max |M_k PE[pos] - PE[pos+k]|`` over every
   position, every feature pair and several offsets k, with ``M_k`` built from the formula above (float64, and
   float32 for comparison).
2. On :func:`tformer.functional.apply_rotary`: fixed random q, k placed at every pair of positions (m, n); the
   scores ``S[m, n] = RoPE(q, m) . RoPE(k, n)``; the largest spread (max - min) along any diagonal n - m = const
   (0 if the claim holds), for both pair layouts. For contrast, the same spread when the sinusoidal code is added
   to q and k (absolute positions), which the claim does not cover.

Shapes: T, C, D (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tformer.experiments._common import Table, fmt, new_figure, save_figure
from tformer.functional import apply_rotary, sinusoidal_positional_encoding

QUESTION = "Q2(b), Q2(c)"
TITLE = "Sinusoidal and rotary positions"
CLAIM = (
    "Sinusoidal: the pair (sin(w_i pos), cos(w_i pos)) at pos + k is M_k (pair at pos) with M_k = "
    "[[cos(w_i k), sin(w_i k)], [-sin(w_i k), cos(w_i k)]], a rotation independent of pos. RoPE: "
    "(R(m theta) q)^T (R(n theta) k) = q^T R((n - m) theta) k depends only on n - m."
)
SIZES: dict[str, dict] = {
    "quick": dict(num_positions=128, d_model=32, offsets=(1, 3, 10, 50), rope_dim=16, rope_positions=32),
    "report": dict(num_positions=512, d_model=128, offsets=(1, 2, 5, 10, 50, 100, 250), rope_dim=64, rope_positions=64),
}
BASE = 10000.0


@dataclass
class PositionsResult:
    """Errors of the two claims, and the tables the heat maps show."""

    num_positions: int
    d_model: int
    offsets: list[int]
    rotation_error_f64: list[float]  # per offset: max |M_k PE[pos] - PE[pos+k]|, float64
    rotation_error_f32: list[float]  # ... float32 table and arithmetic
    rope_dim: int
    rope_positions: int
    rope_spread_f64: dict[str, float]  # layout -> max over diagonals of (max - min) of S, float64
    rope_spread_f32: dict[str, float]
    absolute_spread: float  # same measure for sinusoidal codes added to q and k
    score_scale: float  # max |S|, to read the spreads against
    pe_table: Tensor  # (num_positions, d_model) float64
    rope_scores: Tensor  # (rope_positions, rope_positions), interleaved layout, float64
    absolute_scores: Tensor  # (rope_positions, rope_positions)

    def tables(self) -> list[Table]:
        sin_rows = tuple(
            (str(k), fmt(e64), fmt(e32))
            for k, e64, e32 in zip(self.offsets, self.rotation_error_f64, self.rotation_error_f32, strict=True)
        )
        rope_rows = tuple(
            (f"RoPE, {layout}", fmt(self.rope_spread_f64[layout]), fmt(self.rope_spread_f32[layout]))
            for layout in self.rope_spread_f64
        ) + (("sinusoidal added to q, k (absolute)", fmt(self.absolute_spread), "-"),)
        return [
            Table(
                ("offset k", "max error, float64", "max error, float32"),
                sin_rows,
                f"Sinusoidal: max |M_k PE[pos] - PE[pos+k]| over {self.num_positions} positions and "
                f"{self.d_model // 2} pairs",
            ),
            Table(
                ("scores", "max spread along a diagonal, float64", "float32"),
                rope_rows,
                f"Scores S[m, n] for {self.rope_positions} x {self.rope_positions} positions, head dim "
                f"{self.rope_dim} (max |S| = {fmt(self.score_scale)}); 0 = a function of n - m only",
            ),
        ]

    def findings(self) -> list[str]:
        rope = ", ".join(f"{k} {fmt(v)}" for k, v in self.rope_spread_f64.items())
        return [
            f"sinusoidal shift = rotation: max error {fmt(max(self.rotation_error_f64))} in float64 "
            f"({fmt(max(self.rotation_error_f32))} in float32) over offsets {self.offsets}",
            f"RoPE scores are constant along diagonals up to {rope} in float64 (max |S| = {fmt(self.score_scale)}), "
            f"while adding absolute sinusoidal codes to q and k leaves a spread of {fmt(self.absolute_spread)}",
        ]

    def plot(self, out_dir: Path) -> list[Path]:
        fig, axes = new_figure(ncols=3, size=(3.9, 3.5))
        shown = min(self.num_positions, 128)
        im = axes[0, 0].imshow(self.pe_table[:shown].numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
        axes[0, 0].set_title(f"Q2(b): sinusoidal PE (d = {self.d_model})", fontsize=9)
        axes[0, 0].set_xlabel("feature (sin, cos pairs)")
        axes[0, 0].set_ylabel("position")
        fig.colorbar(im, ax=axes[0, 0], fraction=0.046)
        for ax, scores, title in (
            (axes[0, 1], self.rope_scores, "Q2(c): RoPE q_m . k_n"),
            (axes[0, 2], self.absolute_scores, "(q+PE_m) . (k+PE_n), absolute"),
        ):
            lim = float(scores.abs().max())
            im = ax.imshow(scores.numpy(), cmap="RdBu", vmin=-lim, vmax=lim)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("key position n")
            ax.set_ylabel("query position m")
            fig.colorbar(im, ax=ax, fraction=0.046)
        return [save_figure(fig, out_dir, "positions")]


def rotation_error(pe: Tensor, offset: int, base: float = BASE) -> float:
    """``max |M_k PE[pos] - PE[pos+k]|`` over positions and feature pairs for one offset ``k``.

    ``PE[pos, 2i] = sin(w_i pos)``, ``PE[pos, 2i+1] = cos(w_i pos)``; ``M_k`` as in the claim, from its formula.
    """
    num_positions, d = pe.shape
    omega = base ** (-torch.arange(0, d - 1, 2, dtype=torch.float64) / d)  # (d/2,)
    c = torch.cos(omega * offset).to(pe.dtype)
    s = torch.sin(omega * offset).to(pe.dtype)
    sin, cos = pe[: num_positions - offset, 0::2], pe[: num_positions - offset, 1::2]  # (T - offset, C/2) each
    predicted_sin = c * sin + s * cos  # first row of M_k
    predicted_cos = -s * sin + c * cos  # second row of M_k
    target = pe[offset:]
    return max(
        float((predicted_sin - target[:, 0::2]).abs().max()), float((predicted_cos - target[:, 1::2]).abs().max())
    )


def diagonal_spread(scores: Tensor) -> float:
    """Largest ``max - min`` of ``scores (T, T)`` along any diagonal ``n - m = const``."""
    T = scores.shape[0]
    return max(float(d.max() - d.min()) for d in (torch.diagonal(scores, offset) for offset in range(-T + 1, T)))


def rope_scores(q: Tensor, k: Tensor, num_positions: int, interleaved: bool) -> Tensor:
    """``S[m, n] = RoPE(q, m) . RoPE(k, n)`` for one query and one key vector ``(D,)``; shape ``(T, T)``."""
    qs = apply_rotary(q.expand(num_positions, -1), 0, BASE, interleaved)  # (T, D): row m rotated by m theta
    ks = apply_rotary(k.expand(num_positions, -1), 0, BASE, interleaved)  # (T, D)
    return qs @ ks.T  # (T, D) @ (D, T) -> (T, T)


def run(
    num_positions: int = 128,
    d_model: int = 32,
    offsets: Sequence[int] = (1, 3, 10, 50),
    rope_dim: int = 16,
    rope_positions: int = 32,
    seed: int = 0,
) -> PositionsResult:
    """Both claims at the given sizes (offsets must be smaller than ``num_positions``)."""
    if max(offsets) >= num_positions:
        raise ValueError(f"offsets {offsets} must be smaller than num_positions={num_positions}")
    pe64 = sinusoidal_positional_encoding(num_positions, d_model, BASE, dtype=torch.float64)
    pe32 = sinusoidal_positional_encoding(num_positions, d_model, BASE, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rope_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(rope_dim, generator=gen, dtype=torch.float64)
    layouts = {"interleaved": True, "rotate-half": False}
    spread64 = {name: diagonal_spread(rope_scores(q, k, rope_positions, il)) for name, il in layouts.items()}
    spread32 = {
        name: diagonal_spread(rope_scores(q.float(), k.float(), rope_positions, il)) for name, il in layouts.items()
    }
    scores = rope_scores(q, k, rope_positions, True)
    pe = sinusoidal_positional_encoding(rope_positions, rope_dim, BASE, dtype=torch.float64)  # (T, D)
    absolute = (q + pe) @ (k + pe).T  # (T, D) @ (D, T) -> (T, T)
    return PositionsResult(
        num_positions=num_positions,
        d_model=d_model,
        offsets=list(offsets),
        rotation_error_f64=[rotation_error(pe64, o) for o in offsets],
        rotation_error_f32=[rotation_error(pe32, o) for o in offsets],
        rope_dim=rope_dim,
        rope_positions=rope_positions,
        rope_spread_f64=spread64,
        rope_spread_f32=spread32,
        absolute_spread=diagonal_spread(absolute),
        score_scale=float(scores.abs().max()),
        pe_table=pe64,
        rope_scores=scores,
        absolute_scores=absolute,
    )
