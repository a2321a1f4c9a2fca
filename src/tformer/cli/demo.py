"""``tformer demo``: train the encoder-decoder on a built-in sequence task and report accuracy.

(``add`` is left out: ``format_result`` prints each symbol as a digit, so its ``+`` would print as 10, and the demo
has no flag to keep the 16-digit operands short; ``tformer train --task add --task-max-len 3`` trains addition.)
"""

from __future__ import annotations

import argparse
import math
import sys

from tformer.training.demos import format_result, run_demo
from tformer.training.tasks import SequenceTask


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small encoder-decoder to reverse sequences (about a minute)",
        description="Train a small encoder-decoder (2+2 layers, d_model 64) on a built-in task of digit sequences "
        "and report its exact-match accuracy on held-out sequences.",
    )
    p.add_argument("--task", default="reverse", choices=["reverse", "sort", "copy"], help="default reverse")
    p.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step (default 64)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate, in (0, 1] (default 2e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, batches and held-out set (default 0)")
    p.set_defaults(func=_run)


def _check(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first bad flag (before a minute of training is spent)."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer; got {value}")
    if not (math.isfinite(args.lr) and 0 < args.lr <= 1):  # AdamW moves each weight by about lr per step
        raise ValueError(f"--lr must be a number in (0, 1]; got {args.lr:g}")
    if not 0 <= args.seed < 2**63:  # the range `tformer train --seed` takes (numpy's generators take no negative seed)
        raise ValueError(f"--seed must be an integer in [0, 2**63); got {args.seed}")


def _run(args: argparse.Namespace) -> int:
    try:
        _check(args)
    except ValueError as err:
        print(f"tformer demo: error: {err}", file=sys.stderr)
        return 2
    result = run_demo(task=SequenceTask(args.task), steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      seed=args.seed)  # fmt: skip
    print(format_result(result))
    return 0
