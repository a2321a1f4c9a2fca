"""``layernorm``: Pre-LN vs Post-LN, the gradients at initialization and training with and without warmup.

Claim (source, Q3(b)): "Post-LN: x_{l+1} = LN(x_l + F(x_l)) -- the residual is inside the normalisation, so
gradients must pass through every LN, and the identity path is not clean; at large depth this causes gradient
magnitudes to explode/vanish, requiring warmup. Pre-LN: x_{l+1} = x_l + F(LN(x_l)) -- the residual stream is an
unnormalised identity highway; gradients flow additively/unimpeded from top to bottom, keeping gradient norms
bounded and stable, so training proceeds without warmup."

Measured on :class:`tformer.DecoderLM` (``norm_first`` True = Pre-LN, False = Post-LN), with the Xavier-uniform
matrices of the 2017 paper and of Xiong et al. (2020, "On Layer Normalization in the Transformer Architecture"):

1. At initialization, the gradient norm of each block's FFN output matrix W_2 for a random next-token batch, at
   several depths (as tests/core/test_layers.py; Xiong et al. Fig. 3): its growth from the bottom block to the top one,
   its max/min spread, and Post-LN's top-layer gradient over Pre-LN's.
2. Training a small byte-level LM on the source text of Python's ``argparse`` module with :func:`tformer.train`
   (Adam, a constant learning rate, with or without a linear warmup) for both placements: the loss curves, as they
   come.

Shapes: B, T, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tformer.config import TransformerConfig
from tformer.experiments._common import Table, fmt, new_figure, save_figure, single_thread
from tformer.models import DecoderLM
from tformer.training.config import TrainConfig
from tformer.training.runtime import TrainingError
from tformer.training.trainer import train

QUESTION = "Q3(b)"
TITLE = "Pre-LN vs Post-LN"
CLAIM = (
    "Post-LN, x_{l+1} = LN(x_l + F(x_l)): every gradient passes through every LN; at large depth gradient "
    "magnitudes explode/vanish, requiring warmup. Pre-LN, x_{l+1} = x_l + F(LN(x_l)): an identity highway keeps "
    "gradient norms bounded and stable, so training proceeds without warmup."
)
SIZES: dict[str, dict] = {
    "quick": dict(depths=(6, 12), train_depths=(2,), steps=30, warmup_steps=10),
    "report": dict(depths=(6, 12, 24), train_depths=(6, 12), steps=200, warmup_steps=50),
}
PLACEMENTS = {"Pre-LN": True, "Post-LN": False}


def _config(num_layers: int, norm_first: bool, d_model: int, vocab_size: int, max_seq_len: int) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        num_heads=4,
        d_ff=4 * d_model,
        num_layers=num_layers,
        norm_first=norm_first,
        max_seq_len=max_seq_len,
    )


def _xavier_(model: nn.Module) -> None:
    """Xavier-uniform every matrix (embeddings included), as the 2017 paper and Xiong et al. (2020)."""
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.xavier_uniform_(p)


def init_gradient_norms(
    norm_first: bool, num_layers: int, d_model: int = 64, batch: int = 8, seq_len: int = 32, seed: int = 0
) -> list[float]:
    """``||dL/dW_2||`` of each block's FFN output matrix at Xavier initialization, bottom block first (float64)."""
    torch.manual_seed(seed)
    model = DecoderLM(_config(num_layers, norm_first, d_model, 64, 64)).double()
    _xavier_(model)
    ids = torch.randint(0, 64, (batch, seq_len))
    logits = model(ids[:, :-1])  # (B, T-1, V)
    F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    return [float(block.ff.down.weight.grad.norm()) for block in model.decoder.stack.blocks]


def train_curve(
    norm_first: bool,
    num_layers: int,
    warmup_steps: int,
    steps: int,
    lr: float = 1e-3,
    d_model: int = 64,
    batch: int = 16,
    seq_len: int = 64,
    seed: int = 0,
) -> list[float]:
    """Training loss at every step of a byte-level LM on the source of ``argparse.py``, trained by
    :func:`tformer.train` from Xavier matrices: Adam (AdamW without decay), no clipping, lr rising linearly over
    ``warmup_steps`` (0 = none) and then constant (``min_lr = lr``), so the only difference between runs is the
    warmup. A run that diverges ends its curve with NaN."""
    model = dict(
        d_model=d_model,
        num_heads=4,
        d_ff=4 * d_model,
        num_layers=num_layers,
        norm_first=norm_first,
        position="sinusoidal",
        activation="relu",
    )
    with tempfile.TemporaryDirectory() as cache:  # the token cache of this small file, not the user's
        cfg = TrainConfig(
            out=None,
            data=argparse.__file__,
            tokenizer="byte",
            block_size=seq_len,
            batch_size=batch,
            steps=steps,
            lr=lr,
            min_lr=lr,
            warmup=warmup_steps,
            weight_decay=0.0,
            betas=(0.9, 0.98),
            grad_clip=0.0,
            eval_every=0,
            eval_batches=1,
            seed=seed,
            model=model,
            cache_dir=cache,
            progress=False,
        )
        try:
            losses = train(cfg, init=_xavier_).losses
        except TrainingError as err:  # diverged: the curve ends here
            return [err.losses[s] for s in sorted(err.losses)] + [math.nan]
    return [losses[s] for s in sorted(losses)]


@dataclass
class LayerNormResult:
    """Part 1: ``grad_norms[placement][depth]`` per block (bottom first). Part 2: ``curves[(placement, warmup,
    depth)]`` training losses."""

    depths: list[int]
    grad_norms: dict[str, dict[int, list[float]]]
    train_depths: list[int]
    steps: int
    warmup_steps: int
    lr: float
    curves: dict[tuple[str, bool, int], list[float]]
    train_seconds: float

    def top_over_bottom(self, placement: str, depth: int) -> float:
        g = self.grad_norms[placement][depth]
        return g[-1] / g[0]

    def spread(self, placement: str, depth: int) -> float:
        g = self.grad_norms[placement][depth]
        return max(g) / min(g)

    def post_over_pre_top(self, depth: int) -> float:
        return self.grad_norms["Post-LN"][depth][-1] / self.grad_norms["Pre-LN"][depth][-1]

    def final_loss(self, key: tuple[str, bool, int]) -> float:
        """Mean loss of the last 10% of steps (``inf`` when the run diverged)."""
        curve = self.curves[key]
        if len(curve) < self.steps or not math.isfinite(curve[-1]):
            return math.inf
        tail = curve[-max(1, self.steps // 10) :]
        return sum(tail) / len(tail)

    def tables(self) -> list[Table]:
        grad_rows = tuple(
            (
                str(d),
                fmt(self.top_over_bottom("Pre-LN", d)),
                fmt(self.top_over_bottom("Post-LN", d)),
                fmt(self.spread("Pre-LN", d)),
                fmt(self.spread("Post-LN", d)),
                fmt(self.post_over_pre_top(d)),
            )
            for d in self.depths
        )
        train_rows = []
        for (placement, warm, depth), curve in self.curves.items():
            quarter = curve[min(len(curve) - 1, self.steps // 4)]
            train_rows.append(
                (
                    str(depth),
                    placement,
                    f"{self.warmup_steps} steps" if warm else "none",
                    fmt(curve[0]),
                    fmt(quarter),
                    fmt(self.final_loss((placement, warm, depth))),
                )
            )
        return [
            Table(
                (
                    "layers",
                    "Pre-LN top/bottom",
                    "Post-LN top/bottom",
                    "Pre-LN max/min",
                    "Post-LN max/min",
                    "Post-LN top / Pre-LN top",
                ),
                grad_rows,
                "Gradient norm of each block's FFN W_2 at Xavier initialization",
            ),
            Table(
                (
                    "layers",
                    "placement",
                    "warmup",
                    "loss at step 0",
                    f"at step {self.steps // 4}",
                    f"final (mean of last {max(1, self.steps // 10)})",
                ),
                tuple(train_rows),
                f"Byte-level LM on argparse.py, {self.steps} steps, Adam lr {self.lr:g}",
            ),
        ]

    def findings(self) -> list[str]:
        def each(values: list[float]) -> str:
            return "/".join(fmt(v) for v in values)

        depths = "/".join(map(str, self.depths))
        post_tb = [self.top_over_bottom("Post-LN", d) for d in self.depths]
        pre_tb = [self.top_over_bottom("Pre-LN", d) for d in self.depths]
        post_spread = [self.spread("Post-LN", d) for d in self.depths]
        pre_spread = [self.spread("Pre-LN", d) for d in self.depths]
        larger = sum(post > pre for post, pre in zip(post_spread, pre_spread, strict=True))
        directions_hold = min(post_tb) > 1 > max(pre_tb)
        caveat = (
            ". Under this init Pre-LN's gradients are not uniform across depth either; what differs is the "
            "direction (Pre-LN's fall toward the output, Post-LN's grow) and the size at the top"
            if larger < len(self.depths) and directions_hold
            else ""
        )
        lines = [
            f"at init, top/bottom ratio of the W_2 gradient norms at {depths} layers: Post-LN {each(post_tb)} "
            f"({'growing toward the output' if min(post_tb) > 1 else 'not always growing'}), Pre-LN {each(pre_tb)} "
            f"({'falling' if max(pre_tb) < 1 else 'not always falling'}); Post-LN's top-layer gradient is "
            f"{each([self.post_over_pre_top(d) for d in self.depths])} x Pre-LN's",
            f"max/min spread of the per-layer norms: Post-LN {each(post_spread)} vs Pre-LN {each(pre_spread)}: larger "
            f"for Post-LN at {larger} of {len(self.depths)} depths{caveat}",
        ]
        for depth in self.train_depths:
            finals = {(p, w): self.final_loss((p, w, depth)) for p in PLACEMENTS for w in (False, True)}
            diverged = [f"{p}{' + warmup' if w else ''}" for (p, w), v in finals.items() if not math.isfinite(v)]
            best = {p: min(finals[p, False], finals[p, True]) for p in PLACEMENTS}
            lines.append(
                f"training {depth} layers ({self.steps} steps), final loss without / with {self.warmup_steps} warmup "
                f"steps: Pre-LN {fmt(finals['Pre-LN', False])} / {fmt(finals['Pre-LN', True])}, Post-LN "
                f"{fmt(finals['Post-LN', False])} / {fmt(finals['Post-LN', True])}: warmup changes the final loss by "
                f"{finals['Pre-LN', True] - finals['Pre-LN', False]:+.2f} for Pre-LN and "
                f"{finals['Post-LN', True] - finals['Post-LN', False]:+.2f} for Post-LN; with its better schedule "
                f"Post-LN ends {best['Post-LN'] - best['Pre-LN']:+.2f} from Pre-LN; "
                + (f"diverged: {', '.join(diverged)}" if diverged else "no run diverged")
            )
        return lines

    def plot(self, out_dir: Path) -> list[Path]:
        fig, axes = new_figure(ncols=1 + len(self.train_depths), size=(4.3, 3.6))
        ax = axes[0, 0]
        colors = dict(zip(self.depths, ("C0", "C1", "C2", "C3", "C4"), strict=False))
        for d in self.depths:
            for placement, style in (("Pre-LN", "o-"), ("Post-LN", "s--")):
                ax.semilogy(
                    range(1, d + 1),
                    self.grad_norms[placement][d],
                    style,
                    ms=3,
                    color=colors.get(d),
                    label=f"{placement}, {d} layers",
                )
        ax.set_xlabel("block (1 = bottom)")
        ax.set_ylabel("||dL/dW_2|| at init")
        ax.set_title("Q3(b): gradients at initialization", fontsize=9)
        ax.legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2))  # below: inside, it hid curves
        ax.grid(True, which="both", alpha=0.3)
        for ax, depth in zip(axes[0, 1:], self.train_depths, strict=True):
            for (placement, warm, d), curve in self.curves.items():
                if d != depth:
                    continue
                smooth = _moving_average(curve, 10)
                ax.plot(
                    smooth,
                    ("-" if placement == "Pre-LN" else "--"),
                    color="C2" if warm else "C3",
                    label=f"{placement}, {'warmup' if warm else 'no warmup'}",
                )
            ax.set_xlabel("step")
            ax.set_ylabel("training loss (moving average of 10)")
            ax.set_title(f"training, {depth} layers", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(True, alpha=0.3)
        return [save_figure(fig, out_dir, "layernorm")]


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run(
    depths: Sequence[int] = (6, 12),
    train_depths: Sequence[int] = (4,),
    steps: int = 40,
    warmup_steps: int = 10,
    lr: float = 1e-3,
    seed: int = 0,
) -> LayerNormResult:
    """Gradient norms at init for each depth in ``depths``; training curves for each depth in ``train_depths``."""
    grad_norms = {p: {d: init_gradient_norms(nf, d, seed=seed) for d in depths} for p, nf in PLACEMENTS.items()}
    start = time.perf_counter()
    with single_thread():
        curves = {
            (p, warm, depth): train_curve(nf, depth, warmup_steps if warm else 0, steps, lr, seed=seed)
            for depth in train_depths
            for p, nf in PLACEMENTS.items()
            for warm in (False, True)
        }
    return LayerNormResult(
        list(depths), grad_norms, list(train_depths), steps, warmup_steps, lr, curves, time.perf_counter() - start
    )
