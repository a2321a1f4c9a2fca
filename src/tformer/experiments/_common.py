"""Shared pieces of the experiments: result tables, power-law fits, figures, and a layer's attention weights.

Shapes: B, H, Hkv, T, S, C, D (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.functional import attention_weights
from tformer.layers import MultiHeadAttention

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_DPI = 90  # small PNGs: the committed report stays well under 2 MB


@dataclass(frozen=True)
class Table:
    """A small table of already formatted cells, printed as Markdown (readable in a terminal too)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    title: str = ""

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"table {self.title!r}: row {row} has {len(row)} cells, expected {len(self.columns)}")

    def markdown(self) -> str:
        """GitHub Markdown; a ``|`` inside a cell is escaped."""
        columns = tuple(c.replace("|", "\\|") for c in self.columns)
        rows = tuple(tuple(c.replace("|", "\\|") for c in r) for r in self.rows)
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

        def line(cells: Sequence[str]) -> str:
            return "| " + " | ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)) + " |"

        lines = [f"**{self.title}**", ""] if self.title else []
        lines += [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += [line(r) for r in rows]
        return "\n".join(lines)


class ExperimentResult(Protocol):
    """What every experiment returns: its figures as data, plus ways to show them."""

    def tables(self) -> list[Table]: ...

    def findings(self) -> list[str]:
        """One sentence per measured figure that bears on the claim."""
        ...

    def plot(self, out_dir: Path) -> list[Path]:
        """Write the experiment's PNG(s) into ``out_dir``; return their paths."""
        ...


def fmt(x: float, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits; scientific notation for very small or large magnitudes."""
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    if 10**digits <= abs(x) < 1e6:
        return f"{x:.0f}"
    if 1e-3 <= abs(x) < 10**digits:
        return f"{x:.{digits}g}"
    return f"{x:.{max(digits - 1, 0)}e}"


def fmt_alike(values: Sequence[float], digits: int = 3) -> list[str]:
    """``values`` written alike, for numbers shown side by side (``2.00 / 2.13``, not ``2 / 2.13``): ``digits``
    significant digits with their trailing zeros, and all in scientific notation when any one needs it (a
    magnitude below 1e-3 or from 1e6, as :func:`fmt`). Zero is ``0``."""

    def rounded(v: float) -> float:  # as printed: 999.7 at 3 digits is 1000
        return abs(float(f"{v:.{digits}g}"))

    plain = [math.isfinite(v) and v != 0 for v in values]  # zero, inf and nan: as fmt writes them
    if any(p and not 1e-3 <= rounded(v) < 1e6 for v, p in zip(values, plain, strict=True)):
        return [f"{v:.{max(digits - 1, 0)}e}" if p else fmt(v) for v, p in zip(values, plain, strict=True)]
    out = []
    for v, p in zip(values, plain, strict=True):
        if not p:
            out.append(fmt(v))
        elif rounded(v) >= 10**digits:  # 1234, not 1.23e+03
            out.append(f"{v:.0f}")
        else:
            out.append(f"{v:#.{digits}g}".rstrip("."))  # '#' keeps the trailing zeros; 123. -> 123
    return out


def fmt_range(values: Sequence[float], digits: int = 3) -> str:
    """The range of ``values`` as ``A to B`` (:func:`fmt_alike`), or one number when both ends read the same."""
    return span(*fmt_alike([min(values), max(values)], digits))


def span(low: str, high: str) -> str:
    """``low to high`` for two formatted ends, or ``low`` alone when they read the same ("to", not a hyphen,
    which beside a number in exponent notation reads as a minus)."""
    return low if low == high else f"{low} to {high}"


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> float:
    """Exponent ``p`` of ``y ~ c x^p``: the least-squares slope of ``log y`` against ``log x``.

    Needs at least two points with distinct ``x``, all positive.
    """
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.shape != ys.shape or xs.size < 2 or np.unique(xs).size < 2:
        raise ValueError(f"a power-law fit needs >= 2 points with distinct x; got x={list(xs)}, y={list(ys)}")
    if (xs <= 0).any() or (ys <= 0).any():
        raise ValueError(f"a power-law fit needs positive x and y; got x={list(xs)}, y={list(ys)}")
    slope, _ = np.polyfit(np.log(xs), np.log(ys), 1)
    return float(slope)


def new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (4.2, 3.4)) -> tuple[Figure, np.ndarray]:
    """A figure of ``nrows x ncols`` panels (each ``size`` inches) on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
    return fig, axes


def save_figure(fig: Figure, out_dir: Path, name: str) -> Path:
    """Save ``fig`` as ``out_dir/name.png`` and close it."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
    return path


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread inside the block (restored after).

    For the tiny models the experiments train, thread synchronisation costs more than it saves: on a shared
    2-core machine two threads made a 6-layer LM step 6x slower than one.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def layer_queries_keys(
    mha: MultiHeadAttention,
    x: Tensor,
    context: Tensor | None = None,
    *,
    positions: Tensor | None = None,
    rotate: bool = True,
) -> tuple[Tensor, Tensor]:
    """The per-head queries ``(B, H, T, D)`` and keys ``(B, Hkv, S, D)`` that ``mha`` computes for one call.

    Recomputed from the layer's own weights: ``Q = x W^Q``, ``K = context W^K`` (``context = x`` for
    self-attention), then RoPE when the layer has it (``rotate=False``: the projections before it). Arguments
    mirror :meth:`MultiHeadAttention.forward`.
    """
    C, D = mha.d_model, mha.head_dim
    kv_dim = mha.num_kv_heads * D
    weight, bias = mha.in_proj.weight, mha.in_proj.bias
    source = x if context is None else context
    q = F.linear(x, weight[:C], None if bias is None else bias[:C])  # (B, T, C)
    k = F.linear(source, weight[C : C + kv_dim], None if bias is None else bias[C : C + kv_dim])  # (B, S, Hkv*D)
    B, T, S = x.shape[0], x.shape[1], source.shape[1]
    q = q.view(B, T, mha.num_heads, D).transpose(1, 2)  # (B, T, H*D) -> (B, H, T, D)
    k = k.view(B, S, mha.num_kv_heads, D).transpose(1, 2)  # (B, S, Hkv*D) -> (B, Hkv, S, D)
    if rotate and mha.rotary is not None and context is None:
        pos = torch.arange(T, device=x.device) if positions is None else positions
        mha.rotary.reserve(T)
        rope = mha.rotary(pos)  # the angles of these positions
        q, k = mha.rotary.rotate(q, rope), mha.rotary.rotate(k, rope)
    return q, k


def per_head_queries_keys(
    mha: MultiHeadAttention, x: Tensor, context: Tensor | None = None, *, rotate: bool = True
) -> tuple[Tensor, Tensor]:
    """:func:`layer_queries_keys` with the keys of grouped-query heads repeated for the query heads they serve:
    ``(B, H, T, D)`` and ``(B, H, S, D)``."""
    q, k = layer_queries_keys(mha, x, context, rotate=rotate)
    return q, k.repeat_interleave(mha.num_heads // mha.num_kv_heads, dim=1)


def attention_inputs(
    model: torch.nn.Module, run
) -> dict[MultiHeadAttention, tuple[Tensor, Tensor | None, Tensor | None, bool]]:
    """Each attention layer of ``model`` with the inputs of its call during ``run()``: ``(x, context, attn_mask,
    is_causal)`` (detached), in the order of the calls (forward pre-hooks, removed afterwards)."""
    inputs: dict = {}

    def hook(module, args, kwargs):
        x = args[0]
        context = args[1] if len(args) > 1 else kwargs.get("context")
        mask = args[2] if len(args) > 2 else kwargs.get("attn_mask")
        causal = args[3] if len(args) > 3 else kwargs.get("is_causal", False)
        inputs[module] = (x.detach(), None if context is None else context.detach(), mask, bool(causal))

    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return inputs


@torch.no_grad()
def layer_attention_probs(
    mha: MultiHeadAttention,
    x: Tensor,
    context: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    *,
    positions: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """The attention probabilities ``A (B, H, T, S)`` inside ``mha`` for the inputs of one forward call.

    :func:`tformer.functional.attention_weights` on :func:`layer_queries_keys`, with the same mask and
    ``scale`` (default ``1/sqrt(D)`` as in the layer; ``scale=1.0`` is "unscaled").
    """
    q, k = layer_queries_keys(mha, x, context, positions=positions)
    return attention_weights(q, k, attn_mask, is_causal, scale)  # (B, H, T, S)


def entropy(probs: Tensor) -> Tensor:
    """Shannon entropy ``-sum_j a_j log a_j`` (nats) of each row of ``probs (..., S)``; ``0 log 0 = 0``."""
    return -(probs * torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))).sum(-1)
