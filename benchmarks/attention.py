"""Time and memory of exact attention backends as the sequence length grows.

Backends: ``reference`` (materialized ``softmax(Q K^T / sqrt(E)) V``, O(n^2) memory), ``tiled``
(:func:`tformer.attention.tiled.tiled_attention`), ``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``)
and, on CUDA, ``triton`` (:func:`tformer.attention.triton.triton_attention`) and SDPA held to one of PyTorch's
kernels each: ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn`` (``torch.nn.attention.sdpa_kernel``; one that
cannot run the inputs is reported as unsupported).

Shapes: batch B = 1, H heads, head dim E, L = S = n, inputs in ``--dtype``. Useful FLOPs (FlashAttention
convention, the recomputation in the backward not counted): forward ``4 * B * H * n^2 * E`` (half of it when
causal), backward 2.5x the forward, so forward+backward is 3.5x. The backward's time is that of
forward+backward less that of the forward. Throughput in GFLOP/s on CPU, TFLOP/s on CUDA.
Time, CPU: best wall time of several runs in this process, the backends taking turns. CUDA: median of
``--repeats`` calls timed by CUDA events after a warm-up (which also autotunes the Triton kernels), each call
queued behind a 1 GiB memset so that the host's launch time is not counted (as ``triton.testing.do_bench``
does); on CUDA each row also gives its ratios to the best ``sdpa-*`` kernel of the row (forward and backward
TFLOP/s, each against the fastest kernel for that pass) and the largest error of out, dQ, dK, dV against SDPA
in float32 on the same inputs, relative to the largest magnitude (bfloat16 kernels: ~1e-2; a bug: ~1).
Peak memory (``peak MiB``): the most bytes one forward+backward had allocated at once beyond its inputs (outputs,
gradients and every temporary), from the allocator's own accounting
(:func:`tformer.experiments.memory.peak_allocated_bytes`: PyTorch's profiler memory events on CPU,
``torch.cuda.max_memory_allocated`` on CUDA); exact, whatever else the machine runs. With ``--rss``, also the
growth of the whole process's peak resident set (``RSS MiB``, extra information: page-level, and noisy on a busy
machine), each case in a fresh subprocess (CPU, Linux: the peak is reset through /proc/self/clear_refs, and glibc
is told to return every block >= 64 KiB on free, so the peak follows live tensors).

    python benchmarks/attention.py            # n = 512 ... 16384, causal and not
    python benchmarks/attention.py --quick    # n = 512 ... 2048, fewer runs
    python benchmarks/attention.py --threads 1  # one core per backend: fairer on a loaded machine
    python benchmarks/attention.py --quick --rss  # and the resident-set growth of each case
    python benchmarks/attention.py --dtype bfloat16 --dims 64 128 --no-memory   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from tformer.attention import scaled_dot_product_attention
from tformer.attention.tiled import tiled_attention
from tformer.experiments.memory import peak_allocated_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SDPA_KERNELS = {  # backend name -> torch.nn.attention.SDPBackend member
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}
BACKENDS = ["reference", "tiled", "sdpa", *SDPA_KERNELS, "triton"]


def materialized(q, k, v, is_causal):
    """The O(n^2) reference: scores, softmax and product written out (tformer's ``reference`` backend)."""
    return scaled_dot_product_attention(q, k, v, is_causal=is_causal, backend="reference")


def sdpa_kernel_only(kernel):
    """SDPA allowed one PyTorch kernel (an ``SDPBackend`` member name); it raises on inputs that kernel cannot run."""

    def attention(q, k, v, c):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, kernel)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=c)

    return attention


def backend_fn(name):
    if name == "reference":
        return materialized
    if name == "tiled":
        return lambda q, k, v, c: tiled_attention(q, k, v, is_causal=c)
    if name == "sdpa":
        return lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)
    if name in SDPA_KERNELS:
        return sdpa_kernel_only(SDPA_KERNELS[name])
    if name == "triton":
        from tformer.attention.triton import triton_attention

        return lambda q, k, v, c: triton_attention(q, k, v, is_causal=c)
    raise ValueError(f"unknown backend {name!r}")


def estimated_bytes(name, n, heads, dim, itemsize):
    """Rough peak of forward+backward: inputs, outputs and grads (~10 x n x E per head) plus, for the
    reference, six (n, n) tensors per head (scores, masked copies, weights and their gradients)."""
    linear = 10 * heads * n * dim * itemsize
    return linear + (6 * heads * n * n * itemsize if name == "reference" else 0)


def available_bytes():
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def inputs(n, heads, dim, device, dtype, grad=True):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g).to(device, dtype).requires_grad_(grad) for _ in range(3))
    return q, k, v, torch.randn(1, heads, n, dim, generator=g).to(device, dtype)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_median_s(fn, repeats):
    """Median seconds of one call of ``fn`` over ``repeats`` calls, timed by CUDA events. A 1 GiB memset
    before each call keeps the GPU busy while the host queues the call (so launch overhead on the host
    is not counted, as in ``triton.testing.do_bench``) and evicts the L2 cache."""
    flush = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def failure(name, error):
    """Table text for a backend that raised: SDPA kernels refusing the inputs are 'unsupported'."""
    if not name.startswith("sdpa-"):
        traceback.print_exc(file=sys.stderr)
    message = (str(error).strip().splitlines() or [""])[0][:120].replace("|", "/")
    return f"{'unsupported' if name.startswith('sdpa-') else 'failed'} ({type(error).__name__}: {message})"


def relative_error(got, ref):
    """max over (out, dQ, dK, dV) of max |x - r| / max |r|."""
    return max(((x.float() - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


def float32_reference(q, k, v, dout, causal):
    """Output and gradients of SDPA in float32 on the same values (None if that fails)."""
    try:
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        out32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
        return (out32.detach(), *torch.autograd.grad(out32, (q32, k32, v32), dout.float()))
    except Exception:  # a report only: the timings go on without it
        traceback.print_exc()
        return None


def time_cases(names, n, causal, dim, args):
    """Time of forward and of forward+backward per backend, {name: (fwd_s, fwd_bwd_s)}, or {name: reason}
    for a backend that raised; and on CUDA {name: relative error against SDPA in float32}.

    CPU: the backends take turns (round robin, after one untimed warm-up each) so that a burst of load from
    other users of the machine hits all of them alike; up to ``args.repeats`` rounds within ``args.budget``,
    best time. CUDA: one backend after another, median of ``args.repeats`` calls.
    """
    q, k, v, dout = inputs(n, args.heads, dim, args.device, args.dtype)
    cuda = args.device == "cuda"
    reference = float32_reference(q, k, v, dout, causal) if cuda else None
    runs, results, errors = {}, {}, {}  # errors: name -> relative error, None if unknown
    for name in names:
        fn = backend_fn(name)

        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v, causal)

        def forward_backward(fn=fn):
            q.grad = k.grad = v.grad = None
            out = fn(q, k, v, causal)
            out.backward(dout)
            return out

        try:
            forward()
            out = forward_backward()  # warm-up: compilation, autotuning, library plans
            got = (out.detach(), q.grad, k.grad, v.grad)
            errors[name] = None if reference is None else relative_error(got, reference)
            sync()
        except Exception as error:  # a backend that cannot run these inputs is reported, not fatal
            results[name] = failure(name, error)
            continue
        runs[name] = (forward, forward_backward)
    if cuda:
        for name, pair in runs.items():
            try:
                results[name] = tuple(cuda_median_s(fn, args.repeats) for fn in pair)
            except Exception as error:
                results[name] = failure(name, error)
    else:
        best = {name: [math.inf, math.inf] for name in runs}
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
        results.update({name: tuple(t) for name, t in best.items()})
    return {name: results[name] for name in names}, errors


def measure_memory(name, n, causal, heads, dim, device, dtype_name):
    """Peak extra bytes of one forward+backward, from the allocator's accounting (in this process)."""
    fn = backend_fn(name)
    dtype = DTYPES[dtype_name]
    # warm up thread pools and libraries; on CUDA at full size, so that autotuning runs before the peak is reset
    q, k, v, dout = inputs(n if device == "cuda" else 64, heads, dim, device, dtype)
    fn(q, k, v, causal).backward(dout)
    q, k, v, dout = inputs(n, heads, dim, device, dtype)
    return peak_allocated_bytes(lambda: fn(q, k, v, causal).backward(dout), device)


def measure_rss_here(name, n, causal, heads, dim, device, dtype_name):
    """Growth of the peak resident set during one forward+backward (run inside the probing subprocess; CPU)."""
    fn = backend_fn(name)
    q, k, v, dout = inputs(64, heads, dim, device, DTYPES[dtype_name])
    fn(q, k, v, causal).backward(dout)  # warm up thread pools and BLAS buffers
    q, k, v, dout = inputs(n, heads, dim, device, DTYPES[dtype_name])
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


def memory_case(name, n, causal, dim, args):
    """(allocator peak, resident-set growth or None) of one case."""
    peak = measure_memory(name, n, causal, args.heads, dim, args.device, args.dtype_name)
    if not args.rss or args.device == "cuda":
        return peak, None
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    probe = json.dumps([name, n, causal, args.heads, dim, args.device, args.dtype_name])
    out = subprocess.run([sys.executable, __file__, "--rss-probe", probe], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return peak, None
    return peak, int(out.stdout.strip().splitlines()[-1])


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


def ratio(x, best):
    """x / best, or None when either is unknown (0)."""
    return x / best if x > 0 and best > 0 else None


def fmt(x, spec):
    return "-" if x is None else f"{x:{spec}}"


def table(dim, backends, args):
    """Benchmark every size and backend for head dim ``dim`` and print the table; returns the CUDA ratios
    of the triton backend, {(n, causal): (fwd / best sdpa, bwd / best sdpa)}."""
    cuda = args.device == "cuda"
    unit, scale = ("TFLOP/s", 1e12) if cuda else ("GFLOP/s", 1e9)
    ms = ".3f" if cuda else ".1f"
    device = f"cuda ({torch.cuda.get_device_name()})" if cuda else "cpu"
    print(
        f"# device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype_name}, "
        f"B=1 H={args.heads} E={dim}; load average at start {os.getloadavg()[0]:.1f}\n"
    )
    columns = [
        "n",
        "causal",
        "backend",
        "fwd ms",
        f"fwd {unit}",
        "bwd ms",
        f"bwd {unit}",
        "fwd+bwd ms",
        f"fwd+bwd {unit}",
    ]
    columns += ["fwd / best sdpa", "bwd / best sdpa", "max rel err"] if cuda else ["fwd+bwd / sdpa"]
    columns += ["peak MiB", "RSS MiB"] if args.rss else ["peak MiB"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    results, triton_ratios = {}, {}
    for causal in (False, True):
        for n in args.sizes:
            row, runnable = {}, []
            for name in backends:
                need = estimated_bytes(name, n, args.heads, dim, args.dtype.itemsize)
                if need > 0.5 * available_bytes():
                    row[name] = f"skipped (needs {need / 2**30:.1f} GB)"
                else:
                    runnable.append(name)
            timed, errors = time_cases(runnable, n, causal, dim, args)
            for name, r in timed.items():
                if isinstance(r, str):
                    row[name] = r
                    continue
                mem = (None, None) if args.no_memory or causal else memory_case(name, n, causal, dim, args)
                row[name] = (*r, mem)
            fl = flops(n, args.heads, dim, causal)
            rate = {
                name: (fl / r[0], 2.5 * fl / (r[1] - r[0]) if r[1] > r[0] else 0.0)
                for name, r in row.items()
                if isinstance(r, tuple)
            }
            best = [max((rate[name][i] for name in rate if name in SDPA_KERNELS), default=0.0) for i in (0, 1)]
            for name, r in row.items():
                if isinstance(r, str):
                    print(f"| {n} | {causal} | {name} | {r} |" + " |" * (len(columns) - 4))
                    continue
                t_f, t_fb, mem = r
                t_b = f"{(t_fb - t_f) * 1e3:{ms}}" if t_fb > t_f else "-"
                cells = [
                    n,
                    causal,
                    name,
                    f"{t_f * 1e3:{ms}}",
                    f"{fl / t_f / scale:.0f}",
                    t_b,
                    f"{rate[name][1] / scale:.0f}" if t_fb > t_f else "-",
                    f"{t_fb * 1e3:{ms}}",
                    f"{3.5 * fl / t_fb / scale:.0f}",
                ]
                if cuda:
                    ratios = ratio(rate[name][0], best[0]), ratio(rate[name][1], best[1])
                    cells += [fmt(ratios[0], ".2f"), fmt(ratios[1], ".2f"), fmt(errors[name], ".1e")]
                    if name == "triton":
                        triton_ratios[n, causal] = ratios
                else:
                    sd = row.get("sdpa")
                    cells.append(f"{t_fb / sd[1]:.2f}" if isinstance(sd, tuple) else "-")
                shown = mem if args.rss else mem[:1]
                cells += ["-" if m is None else f"{m / 2**20:.1f}" for m in shown]
                print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
                results.setdefault((name, causal), []).append((n, t_f, t_fb, mem[0]))
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")
    print("\n| backend | causal | time exponent (fwd+bwd) | peak-memory exponent |")
    print("|---|---|---|---|")
    for (name, causal), rows in results.items():
        ns = [r[0] for r in rows]
        t_exp = growth_exponent(ns, [r[2] for r in rows])
        m_exp = growth_exponent(ns, [r[3] for r in rows])
        print(f"| {name} | {causal} | {t_exp:.2f} | {'-' if math.isnan(m_exp) else f'{m_exp:.2f}'} |")
    print()
    return triton_ratios


def print_triton_tiles():
    """The tiles triton.autotune chose for each shape it saw (CUDA)."""
    from tformer.attention import triton as attention_triton

    print("# Triton tiles chosen by autotuning; key = (L, S, E, Ev, groups, mask kind, causal, dtype of Q)\n")
    print("| kernel | key | BLOCK_M | BLOCK_N | warps | stages |")
    print("|---|---|---|---|---|---|")
    for name, tuner in attention_triton._AUTOTUNED.items():
        for key, config in tuner.cache.items():
            dtypes = [str(x) for x in key if str(x).startswith("torch.")]  # triton appends each tensor's dtype
            key_s = ", ".join([str(x) for x in key if not str(x).startswith("torch.")] + dtypes[:1])
            print(
                f"| {name} | {key_s} | {config.kwargs['BLOCK_M']} | {config.kwargs['BLOCK_N']} | "
                f"{config.num_warps} | {config.num_stages} |"
            )
    print()


def print_targets(ratios):
    """Issue 3's targets for the Triton kernel against the best SDPA kernel, at n >= 4096."""
    print("# targets: triton fwd >= 0.8x and bwd >= 0.7x the best sdpa-* TFLOP/s at n >= 4096\n")
    print("| E | n | causal | fwd / best sdpa | bwd / best sdpa | met |")
    print("|---|---|---|---|---|---|")
    for (dim, n, causal), (fwd, bwd) in ratios.items():
        if n >= 4096:
            met = "?" if None in (fwd, bwd) else ("yes" if fwd >= 0.8 and bwd >= 0.7 else "no")
            print(f"| {dim} | {n} | {causal} | {fmt(fwd, '.2f')} | {fmt(bwd, '.2f')} | {met} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="n = 512, 1024, 2048 and fewer runs")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="default 512 ... 16384")
    parser.add_argument(
        "--backends",
        nargs="+",
        default=None,
        choices=BACKENDS,
        help="default: reference tiled sdpa (CPU); reference tiled sdpa-flash sdpa-efficient sdpa-cudnn triton (CUDA)",
    )
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", "--dims", dest="dims", type=int, nargs="+", default=[64], help="head dims E")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 5; CUDA 30)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of repeat rounds per size (CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--rss", action="store_true", help="also the resident-set growth (a subprocess per case)")
    parser.add_argument("--rss-probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_probe:
        print(measure_rss_here(*json.loads(args.rss_probe)))
        return
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype_name, args.dtype = args.dtype, DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    args.repeats = args.repeats or (30 if args.device == "cuda" else 5)
    if args.quick:
        args.repeats, args.budget = min(args.repeats, 3), 10.0
    args.sizes = args.sizes or ([512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    cuda_backends = ["reference", "tiled", *SDPA_KERNELS, "triton"]
    backends = args.backends or (cuda_backends if args.device == "cuda" else ["reference", "tiled", "sdpa"])
    ratios = {}
    for dim in args.dims:
        ratios.update({(dim, *key): r for key, r in table(dim, backends, args).items()})
    if args.device == "cuda" and "triton" in backends:
        try:
            print_triton_tiles()
        except Exception:  # a report only
            traceback.print_exc()
        print_targets(ratios)


if __name__ == "__main__":
    main()
