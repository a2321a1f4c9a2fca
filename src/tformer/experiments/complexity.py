"""``complexity``: attention costs O(n^2) time; materialized it costs O(n^2) memory, tiled only O(n).

Claims (source, Q1(c)): "Overall O(n^2 d) time, O(n^2) memory (dominant)." (Q1(d)): "tiling / blockwise
computation -- never materialise the full n x n score matrix; process K, V in blocks and accumulate the output
using an online (streaming) softmax so only O(n) statistics are kept."

Measured for each backend of :func:`tformer.attention.scaled_dot_product_attention` (``reference``: the
materialized scores; ``sdpa``: PyTorch's fused kernel, on CPU a FlashAttention-style tiled kernel; ``tiled``:
tformer's online-softmax implementation), one forward call on ``q, k, v (B, H, n, D)`` float32
under ``no_grad``, as n doubles:

* time: best wall-clock of a few calls in this process (all its threads);
* peak memory: the most bytes the call had allocated at once (its output and every temporary), from PyTorch's
  allocator accounting (:func:`tformer.experiments.memory.peak_allocated_bytes`), on one thread (per-thread
  buffers are not part of the claim). Exact to the byte, and the same on a busy machine.

The exponents are least-squares slopes of ``log cost`` against ``log n``. Tiling saves memory, not arithmetic:
every exact backend's time still grows as n^2.

Shapes: B, H, D (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tformer.attention import scaled_dot_product_attention
from tformer.experiments._common import Table, fit_power_law, fmt, new_figure, save_figure, single_thread
from tformer.experiments.memory import peak_allocated_bytes

QUESTION = "Q1(c), Q1(d)"
TITLE = "The cost of attention, and what tiling saves"
CLAIM = (
    "QK^T is O(n^2 d_k) time and O(n^2) memory; overall O(n^2 d) time, O(n^2) memory. Tiling with an online "
    "softmax never materialises the n x n score matrix: only O(n) statistics (running max and sum) are kept."
)
SIZES: dict[str, dict] = {
    "quick": dict(sizes=(128, 256, 512, 1024), repeats=2),
    "report": dict(sizes=(256, 512, 1024, 2048, 4096), repeats=3),
}
MIB = 2**20


@dataclass
class ComplexityResult:
    """Per backend: ``seconds[b][i]`` and ``peak_mib[b][i]`` at sequence length ``sizes[i]``."""

    sizes: list[int]
    batch: int
    heads: int
    head_dim: int
    threads: int
    seconds: dict[str, list[float]]
    peak_mib: dict[str, list[float]]
    time_exponent: dict[str, float]
    memory_exponent: dict[str, float]
    max_abs_error: dict[str, float]  # against the reference, float32, at the smallest size
    notes: list[str] = field(default_factory=list)

    def score_matrix_mib(self, n: int) -> float:
        """Size of one float32 ``(B, H, n, n)`` score tensor: every head's n x n scores of the whole batch."""
        return self.batch * self.heads * n * n * 4 / MIB

    def tables(self) -> list[Table]:
        backends = list(self.seconds)
        columns = ["n", *(f"{b} time (ms)" for b in backends), *(f"{b} peak (MiB)" for b in backends)]
        columns.append("one (B, H, n, n) score tensor (MiB)")
        rows = [
            (
                str(n),
                *(fmt(1e3 * self.seconds[b][i]) for b in backends),
                *(fmt(self.peak_mib[b][i]) for b in backends),
                fmt(self.score_matrix_mib(n)),
            )
            for i, n in enumerate(self.sizes)
        ]
        rows.append(
            (
                "exponent",
                *(f"{self.time_exponent[b]:.2f}" for b in backends),
                *(f"{self.memory_exponent[b]:.2f}" for b in backends),
                "2",
            )
        )
        title = (
            f"One attention forward, B={self.batch}, H={self.heads}, D={self.head_dim}, float32 "
            f"(time on {self.threads} thread(s); peak = most bytes allocated at once, 1 thread)"
        )
        return [Table(tuple(columns), tuple(rows), title)]

    def findings(self) -> list[str]:
        lines = [
            "memory exponents (claimed 2 materialized, 1 tiled): "
            + ", ".join(f"{b} {e:.2f}" for b, e in self.memory_exponent.items()),
            "time exponents (claimed 2 for every exact backend): "
            + ", ".join(f"{b} {e:.2f}" for b, e in self.time_exponent.items()),
        ]
        n, i = self.sizes[-1], len(self.sizes) - 1
        peaks = ", ".join(f"{b} {fmt(self.peak_mib[b][i])} MiB" for b in self.peak_mib)
        lines.append(
            f"at n = {n}: {peaks}; one (B, H, n, n) float32 score tensor is {fmt(self.score_matrix_mib(n))} MiB "
            f"and the output {fmt(self.batch * self.heads * n * self.head_dim * 4 / MIB)} MiB"
        )
        ratios = ", ".join(f"{b} {self.peak_mib[b][i] / self.score_matrix_mib(n):.3g}" for b in self.peak_mib)
        lines.append(f"peak memory in units of one (B, H, n, n) score tensor at n = {n}: {ratios}")
        tiled = [b for b in self.memory_exponent if b != "reference"]
        if tiled:
            lines.append(
                f"{' and '.join(tiled)} need the O(n) output plus fixed-size tile buffers (O(block_q x block_k), "
                "independent of n): where those dominate, at small n, the fitted memory exponent is below 1"
            )
        errors = ", ".join(f"{b} {e:.1e}" for b, e in self.max_abs_error.items())
        lines.append(f"all backends compute the same attention: max |out - reference| in float32: {errors}")
        return lines + self.notes

    def plot(self, out_dir: Path) -> list[Path]:
        fig, axes = new_figure(ncols=2, size=(4.6, 3.6))
        for ax, data, exps, label in (
            (axes[0, 0], {b: [1e3 * s for s in v] for b, v in self.seconds.items()}, self.time_exponent, "time (ms)"),
            (axes[0, 1], self.peak_mib, self.memory_exponent, "peak extra memory (MiB)"),
        ):
            for b, values in data.items():
                ax.loglog(self.sizes, values, "o-", label=f"{b}: n^{exps[b]:.2f}")
            if label.startswith("peak"):
                scores = [self.score_matrix_mib(n) for n in self.sizes]
                ax.loglog(self.sizes, scores, "k:", lw=1, label="one (B, H, n, n) score tensor")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length n")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        axes[0, 0].set_title("Q1(c): attention time", fontsize=10)
        axes[0, 1].set_title("Q1(d): attention peak memory", fontsize=10)
        return [save_figure(fig, out_dir, "complexity")]


def time_attention(backend: str, n: int, batch: int, heads: int, head_dim: int, repeats: int) -> float:
    """Best-of-``repeats`` seconds of one forward call (after a warm-up call) in this process.

    The minimum, not the mean: on a shared machine other processes only ever add time.
    """
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen) for _ in range(3))  # (B, H, n, D)
    times = []
    with torch.no_grad():
        scaled_dot_product_attention(q, k, v, backend=backend)
        for _ in range(repeats):
            start = time.perf_counter()
            scaled_dot_product_attention(q, k, v, backend=backend)
            times.append(time.perf_counter() - start)
    return min(times)


def peak_memory(backend: str, n: int, batch: int, heads: int, head_dim: int) -> float:
    """Peak bytes one forward call allocates (output included) on one thread."""
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen) for _ in range(3))  # (B, H, n, D)
    with torch.no_grad(), single_thread():
        return float(peak_allocated_bytes(lambda: scaled_dot_product_attention(q, k, v, backend=backend)))


def run(
    sizes: Sequence[int] = (256, 512, 1024, 2048),
    backends: Sequence[str] | None = None,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    repeats: int = 2,
    seed: int = 0,
) -> ComplexityResult:
    """Time and peak memory of one attention forward per backend and sequence length.

    ``backends`` defaults to ``reference``, ``sdpa`` and ``tiled``.
    """
    if len(sizes) < 2:
        raise ValueError(f"need at least two sequence lengths to fit an exponent; got {sizes}")
    notes: list[str] = []
    if backends is None:
        backends = ["reference", "sdpa", "tiled"]
    torch.manual_seed(seed)
    seconds = {b: [time_attention(b, n, batch, heads, head_dim, repeats) for n in sizes] for b in backends}
    peak_mib = {b: [peak_memory(b, n, batch, heads, head_dim) / MIB for n in sizes] for b in backends}
    q = torch.randn(batch, heads, sizes[0], head_dim)
    ref = scaled_dot_product_attention(q, q.flip(-2), q.roll(1, -2), backend="reference")
    errors = {
        b: float((scaled_dot_product_attention(q, q.flip(-2), q.roll(1, -2), backend=b) - ref).abs().max())
        for b in backends
        if b != "reference"
    }
    return ComplexityResult(
        sizes=list(sizes),
        batch=batch,
        heads=heads,
        head_dim=head_dim,
        threads=torch.get_num_threads(),
        seconds=seconds,
        peak_mib=peak_mib,
        time_exponent={b: fit_power_law(sizes, v) for b, v in seconds.items()},
        memory_exponent={b: fit_power_law(sizes, v) for b, v in peak_mib.items()},
        max_abs_error=errors,
        notes=notes,
    )
