"""Time and memory of exact attention backends as the sequence length grows.

Backends: ``reference`` (materialized ``softmax(Q K^T / sqrt(E)) V``, O(n^2) memory), ``tiled``
(:func:`tformer.attention_tiled.tiled_attention`), ``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``)
and, on CUDA, ``triton`` (:func:`tformer.attention_triton.triton_attention`).

Shapes: batch B = 1, H heads, head dim E, L = S = n. Useful FLOPs (FlashAttention convention, the
recomputation in the backward not counted): forward ``4 * B * H * n^2 * E`` (half of it when causal),
backward 2.5x the forward, so forward+backward is 3.5x.
Time: best of several runs in this process, the backends taking turns. Peak memory: forward+backward
of each case in a fresh subprocess, as the growth of the peak resident set over the resident set after
allocating the inputs (CPU, Linux: the peak is reset through /proc/self/clear_refs, and glibc is told
to return every block >= 64 KiB on free, so the peak follows live tensors), or
``torch.cuda.max_memory_allocated`` (CUDA).

    python benchmarks/attention.py            # n = 512 ... 16384, causal and not
    python benchmarks/attention.py --quick    # n = 512 ... 2048, fewer runs
    python benchmarks/attention.py --threads 1  # one core per backend: fairer on a loaded machine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from tformer.attention_tiled import tiled_attention

BYTES = 4  # float32


def materialized(q, k, v, is_causal):
    """The O(n^2) reference: scores, softmax and product written out."""
    try:
        from tformer.functional import scaled_dot_product_attention

        return scaled_dot_product_attention(q, k, v, is_causal=is_causal, backend="reference")
    except (ImportError, TypeError, ValueError):
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, n, n)
        if is_causal:
            n = q.shape[-2]
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(scores, dim=-1) @ v


def backend_fn(name):
    if name == "reference":
        return materialized
    if name == "tiled":
        return lambda q, k, v, c: tiled_attention(q, k, v, is_causal=c)
    if name == "sdpa":
        return lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)
    from tformer.attention_triton import triton_attention

    return lambda q, k, v, c: triton_attention(q, k, v, is_causal=c)


def estimated_bytes(name, n, heads, dim):
    """Rough peak of forward+backward: inputs, outputs and grads (~10 x n x E per head) plus, for the
    reference, six (n, n) tensors per head (scores, masked copies, weights and their gradients)."""
    linear = 10 * heads * n * dim * BYTES
    return linear + (6 * heads * n * n * BYTES if name == "reference" else 0)


def available_bytes():
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def inputs(n, heads, dim, device, grad=True):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g).to(device).requires_grad_(grad) for _ in range(3))
    return q, k, v, torch.randn(1, heads, n, dim, generator=g).to(device)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_cases(names, n, causal, args):
    """Best wall time of forward and of forward+backward per backend, {name: (fwd_s, fwd_bwd_s)}.

    The backends take turns (round robin, after one untimed warm-up each) so that a burst of load from
    other users of the machine hits all of them alike; up to ``args.repeats`` rounds within ``args.budget``.
    """
    q, k, v, dout = inputs(n, args.heads, args.dim, args.device)
    runs = {}
    for name in names:
        fn = backend_fn(name)

        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v, causal)

        def forward_backward(fn=fn):
            q.grad = k.grad = v.grad = None
            fn(q, k, v, causal).backward(dout)

        forward(), forward_backward()  # warm-up
        runs[name] = (forward, forward_backward)
    best = {name: [math.inf, math.inf] for name in names}
    start = time.perf_counter()
    for _ in range(args.repeats):
        for name, pair in runs.items():
            for i, fn in enumerate(pair):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best[name][i] = min(best[name][i], time.perf_counter() - t0)
        if time.perf_counter() - start > args.budget:
            break
    return {name: tuple(t) for name, t in best.items()}


def measure_memory_here(name, n, causal, heads, dim, device):
    """Peak extra bytes of one forward+backward (run inside the measuring subprocess)."""
    fn = backend_fn(name)
    q, k, v, dout = inputs(64, heads, dim, device)
    fn(q, k, v, causal).backward(dout)  # warm up thread pools and libraries at a tiny size
    q, k, v, dout = inputs(n, heads, dim, device)
    if device == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(q, k, v, causal).backward(dout)
        sync()
        return torch.cuda.max_memory_allocated() - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset the peak resident size (VmHWM) to the current one
    base = status_kib("VmRSS")
    fn(q, k, v, causal).backward(dout)
    return (status_kib("VmHWM") - base) * 1024


def status_kib(field):
    """VmHWM (peak) or VmRSS (current) resident size of this process image, in KiB. (Not ru_maxrss:
    that also counts the parent's size at fork.)"""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def memory_case(name, n, causal, args):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--memory-probe", json.dumps([name, n, causal, args.heads, args.dim, args.device])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return int(out.strip().splitlines()[-1])


def flops(n, heads, dim, causal):
    return 4 * heads * n * n * dim * (0.5 if causal else 1.0)


def growth_exponent(ns, values):
    """Least-squares slope of log(value) against log(n): value ~ n^slope."""
    points = [(math.log(n), math.log(v)) for n, v in zip(ns, values, strict=True) if v and v > 0]
    if len(points) < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="n = 512, 1024, 2048 and fewer runs")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="default 512 ... 16384")
    parser.add_argument("--backends", nargs="+", default=None, help="default: reference tiled sdpa (+ triton)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of repeat rounds per size")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        print(measure_memory_here(*json.loads(args.memory_probe)))
        return
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.repeats, args.budget = 3, 10.0
    args.sizes = args.sizes or ([512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    backends = args.backends or ["reference", "tiled", "sdpa"] + (["triton"] if args.device == "cuda" else [])
    print(f"# device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
          f"B=1 H={args.heads} E={args.dim}; load average at start {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print("| n | causal | backend | fwd ms | fwd GFLOP/s | fwd+bwd ms | fwd+bwd GFLOP/s | fwd+bwd / sdpa | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    for causal in (False, True):
        for n in args.sizes:
            row, runnable = {}, []
            for name in backends:
                need = estimated_bytes(name, n, args.heads, args.dim)
                if need > 0.5 * available_bytes():
                    row[name] = f"skipped (needs {need / 2**30:.1f} GB)"
                else:
                    runnable.append(name)
            for name, (t_f, t_fb) in time_cases(runnable, n, causal, args).items():
                mem = None if args.no_memory or causal else memory_case(name, n, causal, args)
                row[name] = (t_f, t_fb, mem)
            for name, r in row.items():
                if isinstance(r, str):
                    print(f"| {n} | {causal} | {name} | {r} | | | | | |")
                    continue
                t_f, t_fb, mem = r
                fl = flops(n, args.heads, args.dim, causal)
                sd = row.get("sdpa")
                ratio = f"{t_fb / sd[1]:.2f}" if isinstance(sd, tuple) else "-"
                mem_s = "-" if mem is None else f"{mem / 2**20:.0f}"
                print(f"| {n} | {causal} | {name} | {t_f * 1e3:.1f} | {fl / t_f / 1e9:.0f} | {t_fb * 1e3:.1f} | "
                      f"{3.5 * fl / t_fb / 1e9:.0f} | {ratio} | {mem_s} |", flush=True)  # fmt: skip
                results.setdefault((name, causal), []).append((n, t_f, t_fb, mem))
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")
    print("\n| backend | causal | time exponent (fwd+bwd) | peak-memory exponent |")
    print("|---|---|---|---|")
    for (name, causal), rows in results.items():
        ns = [r[0] for r in rows]
        t_exp = growth_exponent(ns, [r[2] for r in rows])
        m_exp = growth_exponent(ns, [r[3] for r in rows])
        print(f"| {name} | {causal} | {t_exp:.2f} | {'-' if math.isnan(m_exp) else f'{m_exp:.2f}'} |")


if __name__ == "__main__":
    main()
