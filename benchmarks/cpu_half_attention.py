"""Half-precision attention on the CPU: PyTorch's kernel in the input dtype against the same kernel in float32.

This is the measurement behind ``tformer.attention.cpu_attention_in_float32``: for each dtype and shape it
times ``F.scaled_dot_product_attention`` (causal) on the half-precision inputs as they are ("native"), and on
the inputs cast to float32 with the output cast back ("float32"), forward alone and forward+backward, the
two taking turns in one process (best of several runs). ``native / float32`` > 1 means float32 is faster.
The last column says which one tformer's ``sdpa``/``auto`` backend runs for that shape.

    python benchmarks/cpu_half_attention.py
    python benchmarks/cpu_half_attention.py --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tformer.attention import cpu_attention_in_float32

SHAPES = [  # (batch, heads, n, head dim): training shapes of the benchmark models, then longer sequences
    (12, 4, 64, 32),
    (16, 4, 128, 32),
    (12, 4, 256, 32),
    (4, 8, 512, 64),
    (1, 8, 1024, 64),
    (1, 8, 2048, 64),
]


def best_ms(fns: list[Callable[[], None]], calls: int, rounds: int = 5) -> list[float]:
    """Best time per call of each function, the functions taking turns in each round."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e3)
    return best


def row(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> str:
    b, h, n, e = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, e, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(b, h, n, e, generator=gen).to(dtype)

    def native() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def in_float32() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(dtype)

    calls = max(2, int(4e6 / (b * h * n * n)))
    with torch.no_grad():
        fwd = best_ms([native, in_float32], calls)
    both = best_ms([lambda: native().backward(grad), lambda: in_float32().backward(grad)], calls)
    chosen = "float32" if cpu_attention_in_float32(q, k) else "native"
    name = str(dtype).removeprefix("torch.")
    return (
        f"| {name} | {b}x{h}x{n}x{e} | {fwd[0]:.3f} | {fwd[1]:.3f} | {fwd[0] / fwd[1]:.2f} "
        f"| {both[0]:.3f} | {both[1]:.3f} | {both[0] / both[1]:.2f} | {chosen} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: PyTorch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, causal; times in ms per call\n")
    print(
        "| dtype | B x H x n x E | fwd native | fwd float32 | native/float32 "
        "| fwd+bwd native | fwd+bwd float32 | native/float32 | tformer runs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for dtype in (torch.bfloat16, torch.float16):
        for shape in SHAPES:
            print(row(dtype, shape), flush=True)


if __name__ == "__main__":
    main()
