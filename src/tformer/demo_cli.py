"""``tformer demo``: train the encoder-decoder on the built-in reversal task and report accuracy."""

from __future__ import annotations

import argparse

from tformer.demo import format_result, run_demo
from tformer.tasks import SequenceTask


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small encoder-decoder to reverse sequences (about a minute)")
    p.add_argument("--task", default="reverse", choices=["reverse", "sort", "copy"])
    p.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.batch_size < 1:
        raise SystemExit(f"--steps and --batch-size must be >= 1; got {args.steps}, {args.batch_size}")
    result = run_demo(task=SequenceTask(args.task), steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      seed=args.seed)  # fmt: skip
    print(format_result(result))
    return 0
