"""Sequence-to-sequence benchmark: the 2017 encoder-decoder learns to reverse digit sequences.

Task ``reverse``: sources of 1-16 symbols over a vocabulary of 10 (plus PAD/BOS/EOS); 500 held-out sources are
excluded from training. Trained with ``tformer.training.train`` (the same code as ``tformer train --task reverse``),
then measured by exact match of greedy decodes (key/value cache) on the held-out set. Target: >= 99% in under
5 minutes of wall-clock time on 2 CPU cores, everything included (data, training, evaluation).

    python benchmarks/seq2seq.py                      # the defaults recorded in BENCHMARKS.md
    python benchmarks/seq2seq.py --steps 1000         # a quicker, weaker run
    python benchmarks/seq2seq.py --demo               # also `tformer demo` (tformer.training.demos.run_demo)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tformer.training import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="reverse", choices=["reverse", "sort", "copy", "add"])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    parser.add_argument(
        "--demo", action="store_true", help="also run tformer.training.demos.run_demo with its defaults"
    )
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(
            out=args.out or f"{tmp}/run",
            task=args.task,
            task_max_len=16,
            task_held_out=500,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            min_lr=args.min_lr,
            warmup=args.warmup,
            label_smoothing=args.label_smoothing,
            seed=args.seed,
            eval_every=0,
            save_every=0,
            progress=False,
            model=dict(d_model=args.d_model, num_heads=4, num_layers=args.layers, d_ff=4 * args.d_model),
        )
        start = time.perf_counter()
        result = train(cfg)
        wall = time.perf_counter() - start
        rows.append(("tformer train --task " + args.task, result.step, wall, result.val_accuracy, result.val_loss))
    if args.demo:
        from tformer.training.demos import run_demo

        start = time.perf_counter()
        demo = run_demo(progress=False)
        rows.append(
            ("tformer demo (run_demo defaults)", demo.steps, time.perf_counter() - start, demo.accuracy, float("nan"))
        )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.task}, lengths 1-16, 10 symbols, "
        "500 held-out sources"
    )
    print("\n| run | steps | wall time (s) | held-out exact match | val loss |\n|---|---:|---:|---:|---:|")
    for name, steps, secs, acc, loss in rows:
        print(f"| {name} | {steps} | {secs:.0f} | {100 * acc:.1f}% | {loss:.4f} |")


if __name__ == "__main__":
    main()
