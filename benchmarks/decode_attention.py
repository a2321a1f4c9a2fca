"""tformer's attention kernel for decoding (tformer.engine.kernels.attention) against PyTorch's CPU attention, per call.

A decode step asks attention for one query row per head against the whole key/value cache, once per layer. The
benchmark times one such call, best of ``--repeats`` (each the mean of many calls), at cache lengths S, for

* SmolLM2-135M's heads (9 query heads, 3 key/value heads, head size 64) in bfloat16 and float32;
* the demo model's (4 heads of 32) in float32;

through the engine's ``kernel`` attention backend (``tformer.engine.apply.kernel_attention``) with the kernel on
and off (off: PyTorch's fused CPU kernel, bfloat16 cast to float32 up to 256 keys by the rule of
``tformer.attention.cpu_attention_in_float32``), and PyTorch's ``F.scaled_dot_product_attention`` on the inputs as
they are. A boolean mask hides the last tenth of the keys (a static cache's unwritten columns).

A second table times a static cache an eighth written: the kernel over S columns of which the first S / 8 are
visible, against the kernel over those S / 8 keys alone (it skips the keys after a row's last visible one, so the
unwritten columns should cost little beyond a scan of their mask).

A third table times SmolLM2's bfloat16 call on one thread and on all of torch's threads, in turns (the median of the
per-turn ratios, with quartiles). At batch 1 its 3 key/value heads are 3 tasks, so two threads could at best take
2/3 of one thread's time (2 tasks and 1); the kernel cuts a row's keys into pieces where there are few rows
(attention.cpp, ``kSplitRows``), so that the threads get equal shares.

Run:  python benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from _common import best, cpu_model

from tformer.engine import kernels
from tformer.engine.apply import kernel_attention

HEADS = {"SmolLM2-135M": (9, 3, 64), "demo": (4, 4, 32)}  # query heads, key/value heads, head size


def per_call(fn, repeats: int) -> float:
    """Seconds per call of ``fn()``: the best of ``repeats`` means over enough calls to last ~20 ms."""
    calls = max(10, int(0.02 / max(best(fn, 2), 1e-7)))
    return best(lambda: [fn() for _ in range(calls)], repeats) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--keys", type=int, nargs="+", default=[64, 320, 1024, 4096])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if not kernels.ready():
        raise SystemExit(f"the kernel did not build: {kernels.build_error()}")
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| heads | dtype | keys | kernel us | PyTorch via tformer us | F.sdpa as is us | speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    cases = [("SmolLM2-135M", torch.bfloat16), ("SmolLM2-135M", torch.float32), ("demo", torch.float32)]
    for name, dtype in cases:
        H, Hkv, D = HEADS[name]
        for S in args.keys:
            q = torch.randn(1, H, 1, D).to(dtype)
            k, v = torch.randn(1, Hkv, S, D).to(dtype), torch.randn(1, Hkv, S, D).to(dtype)
            mask = (torch.arange(S) < S - S // 10).view(1, 1, 1, S)
            ours = per_call(partial(kernel_attention, q, k, v, mask), args.repeats)
            with kernels.enabled(False):
                theirs = per_call(partial(kernel_attention, q, k, v, mask), args.repeats)
            pytorch = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, enable_gqa=True)
            raw = per_call(pytorch, args.repeats)
            print(
                f"| {name} {H}/{Hkv}x{D} | {str(dtype)[6:]} | {S} | {ours * 1e6:.1f} | {theirs * 1e6:.1f} | "
                f"{raw * 1e6:.1f} | **{theirs / ours:.2f}x** |",
                flush=True,
            )
    print("\n| heads | dtype | columns | written | kernel us | kernel over the written keys alone us | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, dtype in cases:
        H, Hkv, D = HEADS[name]
        for S in args.keys:
            q = torch.randn(1, H, 1, D).to(dtype)
            k, v = torch.randn(1, Hkv, S, D).to(dtype), torch.randn(1, Hkv, S, D).to(dtype)
            n = S // 8
            mask = (torch.arange(S) < n).view(1, 1, 1, S)
            cache = per_call(partial(kernels.attention, q, k, v, mask, False, None), args.repeats)
            alone = per_call(partial(kernels.attention, q, k[:, :, :n], v[:, :, :n], None, False, None), args.repeats)
            print(
                f"| {name} {H}/{Hkv}x{D} | {str(dtype)[6:]} | {S} | {n} | {cache * 1e6:.1f} | {alone * 1e6:.1f} | "
                f"{cache / alone:.2f} |",
                flush=True,
            )
    threads = torch.get_num_threads()
    print(
        f"\n| heads | dtype | keys | kernel on 1 thread us | on {threads} threads us | speed-up, median (quartiles) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    H, Hkv, D = HEADS["SmolLM2-135M"]
    for S in args.keys:
        q = torch.randn(1, H, 1, D).bfloat16()
        k, v = torch.randn(1, Hkv, S, D).bfloat16(), torch.randn(1, Hkv, S, D).bfloat16()
        call = partial(kernels.attention, q, k, v, None, False, None)
        calls = max(10, int(0.01 / max(best(call, 2), 1e-7)))
        pairs = []  # (one thread, all threads), taken in turns so that the host's drift falls on both alike
        try:
            for _ in range(10 * args.repeats):
                times = []
                for n in (1, threads):
                    torch.set_num_threads(n)
                    start = time.perf_counter()
                    for _ in range(calls):
                        call()
                    times.append((time.perf_counter() - start) / calls)
                pairs.append(times)
        finally:
            torch.set_num_threads(threads)
        one, many = (statistics.median(t[i] for t in pairs) for i in (0, 1))
        q1, q2, q3 = statistics.quantiles([a / b for a, b in pairs], n=4)
        print(
            f"| SmolLM2-135M {H}/{Hkv}x{D} | bfloat16 | {S} | {one * 1e6:.1f} | {many * 1e6:.1f} | "
            f"{q2:.2f}x ({q1:.2f}-{q3:.2f}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
