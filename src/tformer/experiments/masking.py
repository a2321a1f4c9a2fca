"""``masking``: the causal mask must go in before the softmax, or the future leaks into the past.

Claim (source, Q3(a)): "inserting -inf makes e^-inf = 0 so masked positions get exactly zero weight and the
remaining weights renormalise to sum to 1. Masking after softmax (zeroing) would leave the denominator including
future tokens, so probabilities would not sum to 1 and would leak information about future magnitudes."

Measured on the source's ``causal_self_attention(X, Wq, Wk, Wv)`` written with tformer's functions, float64:
the row sums of the weights, and the leakage: replace the token at position p by a fresh random one and take the
largest change of the outputs at positions t < p, over all p (0 means position t sees nothing after it). The
library's own causal paths (``scaled_dot_product_attention(is_causal=True)`` on each CPU backend, ``reference``,
``sdpa`` and ``tiled``, and ``MultiHeadAttention``) are measured the same way. A third variant, zeroing after the
softmax and then renormalising, shows that the leak is the denominator: the rows sum to 1 again and the leak falls to
rounding.

Shapes: T, C, D (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tformer.attention import scaled_dot_product_attention
from tformer.experiments._common import Table, fmt, new_figure, save_figure
from tformer.functional import attention_weights, causal_mask
from tformer.layers import MultiHeadAttention

QUESTION = "Q3(a)"
TITLE = "Causal masking: before or after the softmax"
CLAIM = (
    "Masking with -inf before the softmax gives future positions exactly zero weight and the rest renormalise to "
    "sum to 1. Masking after the softmax (zeroing) leaves future tokens in the denominator: the probabilities do "
    "not sum to 1 and leak information about the future."
)
SIZES: dict[str, dict] = {"quick": dict(seq_len=8, d_model=16), "report": dict(seq_len=16, d_model=32)}

BEFORE = "-inf before softmax"
AFTER = "zeroed after softmax"
RENORM = "zeroed after softmax, renormalised"


@dataclass
class MaskingResult:
    """Per variant: the largest leak, the leak at each position t, and the row sums of the weights."""

    seq_len: int
    d_model: int
    leakage: dict[str, float]  # max |change of out[t]| over t < p when token p changes
    leakage_per_position: dict[str, list[float]]  # max over p > t, per t
    row_sums: dict[str, list[float]]  # only for variants whose weights are available
    weights_before: Tensor  # (T, T)
    weights_after: Tensor  # (T, T)

    def tables(self) -> list[Table]:
        rows = []
        for name, leak in self.leakage.items():
            sums = self.row_sums.get(name)
            rows.append(
                (
                    name,
                    fmt(leak),
                    "-" if sums is None else fmt(min(sums)),
                    "-" if sums is None else fmt(max(abs(s - 1.0) for s in sums)),
                )
            )
        return [
            Table(
                ("causal attention", "max leak from the future", "min row sum", "max deviation of a row sum from 1"),
                tuple(rows),
                f"Causal self-attention, T = {self.seq_len}, d = {self.d_model}, float64",
            )
        ]

    def findings(self) -> list[str]:
        lib = [n for n in self.leakage if n.startswith("library")]
        lib_max = max(self.leakage[n] for n in lib) if lib else float("nan")
        after_sums = self.row_sums[AFTER]
        return [
            f"mask before the softmax: leak {fmt(self.leakage[BEFORE])}, rows sum to 1 within "
            f"{fmt(max(abs(s - 1) for s in self.row_sums[BEFORE]))}; every library causal path: leak {fmt(lib_max)}",
            f"mask after the softmax: leak {fmt(self.leakage[AFTER])} (outputs at t change when a token after t "
            f"changes); row sums from {fmt(min(after_sums))} up to {fmt(max(after_sums))}",
            f"zeroing after the softmax and renormalising: rows sum to 1 again and the leak is "
            f"{fmt(self.leakage[RENORM])} (rounding only): the leak was the denominator",
        ]

    def plot(self, out_dir: Path) -> list[Path]:
        fig, axes = new_figure(ncols=3, size=(3.9, 3.4))
        for ax, w, name in ((axes[0, 0], self.weights_before, BEFORE), (axes[0, 1], self.weights_after, AFTER)):
            im = ax.imshow(w.numpy(), cmap="viridis", vmin=0, vmax=float(self.weights_before.max()))
            ax.set_title(
                f"{name}\nrow sums {fmt(min(self.row_sums[name]))} .. {fmt(max(self.row_sums[name]))}", fontsize=8
            )
            ax.set_xlabel("key position")
            ax.set_ylabel("query position")
            fig.colorbar(im, ax=ax, fraction=0.046)
        ax = axes[0, 2]
        positions = list(range(self.seq_len - 1))
        for name in (AFTER, RENORM, BEFORE):
            ax.plot(positions, self.leakage_per_position[name][:-1], "o-", ms=3, label=name)
        ax.set_yscale("symlog", linthresh=1e-17)
        ax.set_yticks([0.0, 1e-16, 1e-12, 1e-8, 1e-4, 1.0])
        ax.set_xlabel("position t")
        ax.set_ylabel("max |change of out[t]|")
        ax.set_title("Q3(a): leak from tokens after t", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        return [save_figure(fig, out_dir, "masking")]


def causal_self_attention(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, mask: str = BEFORE) -> tuple[Tensor, Tensor]:
    """The source's causal self-attention of ``x (T, C)``: output ``(T, D)`` and weights ``(T, T)``.

    ``mask``: ``BEFORE`` sets future scores to ``-inf`` before the softmax (tformer's convention); ``AFTER``
    takes the softmax over all positions and zeroes the future weights; ``RENORM`` also divides each row by its sum.
    """
    q, k, v = x @ wq, x @ wk, x @ wv  # (T, C) @ (C, D) -> (T, D)
    T = x.shape[0]
    if mask == BEFORE:
        weights = attention_weights(q, k, is_causal=True)  # (T, T)
    elif mask in (AFTER, RENORM):
        weights = attention_weights(q, k) * causal_mask(T, T)  # softmax over every position, then zero j > i
        if mask == RENORM:
            weights = weights / weights.sum(-1, keepdim=True)
    else:
        raise ValueError(f"unknown mask placement {mask!r}; choose one of {BEFORE!r}, {AFTER!r}, {RENORM!r}")
    return weights @ v, weights  # (T, T) @ (T, D) -> (T, D)


def leakage(f: Callable[[Tensor], Tensor], x: Tensor, gen: torch.Generator) -> list[float]:
    """Per position t: the largest ``|f(x')[t] - f(x)[t]|`` when one token ``p > t`` of ``x (T, C)`` is replaced."""
    T = x.shape[0]
    base = f(x)  # (T, D)
    per_t = [0.0] * T
    for p in range(1, T):
        changed = x.clone()
        changed[p] = torch.randn(x.shape[1], generator=gen, dtype=x.dtype)
        delta = (f(changed) - base)[:p].abs().amax(dim=-1)  # (p,): change at each t < p
        per_t[:p] = [max(a, float(b)) for a, b in zip(per_t[:p], delta, strict=True)]
    return per_t


@torch.no_grad()
def run(seq_len: int = 8, d_model: int = 16, seed: int = 0) -> MaskingResult:
    """Leak and row sums of each placement of the mask, and of the library's causal attention paths."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seq_len, d_model, generator=gen, dtype=torch.float64)  # (T, C)
    wq, wk, wv = (torch.randn(d_model, d_model, generator=gen, dtype=torch.float64) / d_model**0.5 for _ in range(3))
    variants: dict[str, Callable[[Tensor], Tensor]] = {
        name: (lambda t, name=name: causal_self_attention(t, wq, wk, wv, name)[0]) for name in (BEFORE, AFTER, RENORM)
    }
    for backend in ("reference", "sdpa", "tiled"):  # triton needs a GPU
        variants[f"library: scaled_dot_product_attention({backend}, is_causal)"] = lambda t, backend=backend: (
            scaled_dot_product_attention(t @ wq, t @ wk, t @ wv, is_causal=True, backend=backend)
        )
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, 4).double().eval()
    variants["library: MultiHeadAttention(is_causal=True)"] = lambda t: mha(t[None], is_causal=True)[0]
    per_position = {name: leakage(f, x, gen) for name, f in variants.items()}
    weights = {name: causal_self_attention(x, wq, wk, wv, name)[1] for name in (BEFORE, AFTER, RENORM)}
    return MaskingResult(
        seq_len=seq_len,
        d_model=d_model,
        leakage={name: max(v) for name, v in per_position.items()},
        leakage_per_position=per_position,
        row_sums={name: w.sum(-1).tolist() for name, w in weights.items()},
        weights_before=weights[BEFORE],
        weights_after=weights[AFTER],
    )
