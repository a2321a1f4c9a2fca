"""The matrix-vector kernels (tformer.engine.kernels) against F.linear, on the matrices of a SmolLM2-135M decode step.

A decode step multiplies one row (or a few: a batch) by every weight matrix once. The benchmark holds SmolLM2-135M's
121 matrices (30 layers of q|k|v, o and gate/up/down, and the 49152 x 576 head), random and distinct, so that they
stream from memory as in a real step (135M parameters, far past the caches), and times one pass over all of them:

* float32 ``F.linear`` (MKL) and the float32 kernel, bfloat16 ``F.linear`` (oneDNN where PyTorch has its bfloat16
  GEMM, else a plain loop), the bfloat16 weights as float32 (``tformer.engine.kernels.float32_gemm``: what those
  other CPUs run past ``tformer.engine.kernels.max_rows``) and the bfloat16 kernel; int8 codes (bfloat16 activations) on
  ``torch._weight_int8pack_mm`` and on the int8 kernel; at M = 1, 2, 4, 8, 16 rows, best of ``--repeats``, in one
  run, the order rotated every repeat;
* the share of the read bandwidth (a ``sum`` over 1 GiB, measured in the same run) each reaches:
  weight bytes / time / bandwidth.

Run:  python benchmarks/gemv.py
(``--library PATH`` times a kernel library built elsewhere, e.g. from an earlier commit's sources, in place of this
checkout's: runs of each, in turns, compare two versions of the kernels on one machine.)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _common import bandwidth, cpu_model

from tformer.engine import kernels
from tformer.engine.quantization import Int8Linear

LAYER = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # qkv, o, gate|up, down: (O, I)
HEAD = (49152, 576)


def one_step(weights: list, rows: int, fn) -> callable:
    """One pass of ``fn(x, w)`` over all matrices, ``x`` of ``rows`` rows (bfloat16 for int8 layers)."""

    def width(w) -> int:
        return w.in_features if isinstance(w, Int8Linear) else w.shape[1]

    dtype = {w.dtype if isinstance(w, torch.Tensor) else torch.bfloat16 for w in weights}.pop()
    xs = {width(w): torch.randn(rows, width(w)).to(dtype) for w in weights}
    return lambda: [fn(xs[width(w)], w) for w in weights]


def pack(x: torch.Tensor, q: Int8Linear) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, q.codes, q.scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="passes over all matrices, order rotated; best kept")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="rows M of the input to time")
    parser.add_argument(
        "--library",
        help="a built kernel library (.so) to time instead of this checkout's (its prefetch set to this checkout's "
        "defaults)",
    )
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.library:
        torch.ops.load_library(args.library)
        for index, kind in enumerate(kernels.WEIGHT_KINDS):
            torch.ops.tformer.gemv_prefetch(kernels.default_prefetch_rows(kind), index)
        paths = f"{torch.ops.tformer.gemv_paths()} from {args.library}"
    elif not kernels.ready():
        raise SystemExit(f"the kernel did not build: {kernels.build_error()}")
    else:
        paths = kernels.paths()
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, kernels {paths}")
    torch.manual_seed(0)
    f32 = [torch.randn(*shape) for _ in range(30) for shape in LAYER] + [torch.randn(*HEAD)]
    bf16 = [w.bfloat16() for w in f32]
    int8 = [Int8Linear.from_weight(w) for w in bf16]
    params = sum(w.numel() for w in f32)
    bw = bandwidth()
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; {len(f32)} matrices, {params / 1e6:.1f}M weights")
    names = [
        "float32 F.linear",
        "float32 kernel",
        "bfloat16 F.linear",
        "bfloat16 as float32",
        "bfloat16 kernel",
        "int8 _weight_int8pack_mm",
        "int8 kernel",
    ]
    ratios = "f32 kernel / F.linear | bf16 kernel / F.linear | bf16 kernel / as float32 | int8 kernel / pack"
    print(f"| rows | {' | '.join(names)} | {ratios} |")
    print("|---:|" + "---:|" * (len(names) + ratios.count("|") + 1))
    for rows in args.rows:
        runs = [
            (one_step(f32, rows, F.linear), 4),
            (one_step(f32, rows, lambda x, w: torch.ops.tformer.gemv_f32(x, w, None)), 4),
            (one_step(bf16, rows, F.linear), 2),
            (one_step(bf16, rows, kernels.float32_gemm), 2),
            (one_step(bf16, rows, lambda x, w: torch.ops.tformer.gemv_bf16(x, w, None)), 2),
            (one_step(int8, rows, pack), 1),
            (one_step(int8, rows, lambda x, q: kernels.int8_linear(x, q.codes, q.scale)), 1),
        ]
        times = [float("inf")] * len(runs)
        for repeat in range(args.repeats):
            for i in [(repeat + j) % len(runs) for j in range(len(runs))]:  # a different order every repeat
                start = time.perf_counter()
                runs[i][0]()
                times[i] = min(times[i], time.perf_counter() - start)
        cells = [
            f"{t * 1e3:.1f} ms ({params * nbytes / t / bw:.0%})" for t, (_, nbytes) in zip(times, runs, strict=True)
        ]
        speedups = " | ".join(f"{times[a] / times[b]:.2f}x" for a, b in ((0, 1), (2, 4), (3, 4), (5, 6)))
        print(f"| {rows} | {' | '.join(cells)} | {speedups} |")
    print("(ms per pass over all matrices; in brackets: weight bytes / time / read bandwidth)")


if __name__ == "__main__":
    main()
