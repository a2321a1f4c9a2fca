"""The bfloat16 matrix-vector kernel (tformer.kernels) against F.linear, on the matrices of a SmolLM2-135M decode step.

A decode step multiplies one row (or a few: a batch) by every weight matrix once. The benchmark holds SmolLM2-135M's
121 matrices (30 layers of q|k|v, o and gate/up/down, and the 49152 x 576 head), random and distinct, so that they
stream from memory as in a real step (135M parameters, far past the caches), and times one pass over all of them:

* float32 ``F.linear`` (MKL), bfloat16 ``F.linear`` (oneDNN) and the kernel, at M = 1, 2, 4, 8, 16 rows, best of
  ``--repeats``, in one run, the order of the three rotated every repeat;
* the share of the read bandwidth (a ``sum`` over 1 GiB, measured in the same run) each reaches:
  weight bytes / time / bandwidth.

Run:  python benchmarks/gemv.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _common import bandwidth, cpu_model

from tformer import kernels

LAYER = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # qkv, o, gate|up, down: (O, I)
HEAD = (49152, 576)


def one_step(weights: list[torch.Tensor], rows: int, fn) -> callable:
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights}
    return lambda: [fn(xs[w.shape[1]], w) for w in weights]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if not kernels.ready():
        raise SystemExit(f"the kernel did not build: {kernels.build_error()}")
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, kernel path {kernels.path()}")
    torch.manual_seed(0)
    f32 = [torch.randn(*shape) for _ in range(30) for shape in LAYER] + [torch.randn(*HEAD)]
    bf16 = [w.bfloat16() for w in f32]
    params = sum(w.numel() for w in f32)
    bw = bandwidth()
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; {len(f32)} matrices, {params / 1e6:.1f}M weights")
    print("| rows | float32 F.linear | bfloat16 F.linear | bfloat16 kernel | kernel / bf16 F.linear |")
    print("|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        runs = {
            "f32": (one_step(f32, rows, F.linear), 4),
            "bf16": (one_step(bf16, rows, F.linear), 2),
            "kernel": (one_step(bf16, rows, lambda x, w: torch.ops.tformer.gemv_bf16(x, w, None)), 2),
        }
        times = {name: float("inf") for name in runs}
        order = list(runs)
        for repeat in range(args.repeats):
            for name in order[repeat % 3 :] + order[: repeat % 3]:
                start = time.perf_counter()
                runs[name][0]()
                times[name] = min(times[name], time.perf_counter() - start)
        cells = [f"{times[n] * 1e3:.1f} ms ({params * runs[n][1] / times[n] / bw:.0%})" for n in runs]
        print(f"| {rows} | {' | '.join(cells)} | {times['bf16'] / times['kernel']:.2f}x |")
    print("(ms per pass over all matrices; in brackets: weight bytes / time / read bandwidth)")


if __name__ == "__main__":
    main()
