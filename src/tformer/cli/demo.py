"""``tformer train-demo`` (the main job of ``make demo``) and ``tformer demo``: thin skins over
:mod:`tformer.training.demos`.

Their training flags are TrainConfig fields (:mod:`tformer.cli.flags`, with the demos' defaults); the sampling flags
of ``train-demo`` are checked by the sampling code. ``demo`` leaves out the ``add`` task: its example lines print
each symbol as a digit, so ``+`` would print as 10 (``tformer train --task add --task-max-len 3`` trains addition).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from tformer.cli.flags import add_train_flags, given_settings
from tformer.training.presets import DEMO, DEMO_MODEL, SEQ2SEQ_DEMO

EXIT_INTERRUPTED = 130
DEMO_TASKS = ["reverse", "sort", "copy"]


def add_cli(subparsers) -> None:
    d = subparsers.add_parser(
        "train-demo",
        help="the main job: a small GPT on the Python stdlib (4-6 min on 2 cores)",
        description="Train a 4-layer GPT (d_model 128, byte-level, context 128) on the Python standard library, "
        "then print its validation loss and a sample, and write the loss plot. --out is replaced each time, but "
        "only if it holds an earlier train-demo run.",
    )
    d.add_argument("--out", default="runs/demo", help="run directory (default runs/demo; replaced each time)")
    add_train_flags(d, only=("steps", "progress"), defaults=DEMO)
    d.add_argument("--prompt", default="def ", help="the start of the sample (default 'def ')")
    d.add_argument("--sample-tokens", type=int, default=400, help="bytes to sample (default 400)")
    d.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, > 0 (default 0.8)")
    d.add_argument("--plot-copy", default=None, help="also copy loss.png here (e.g. docs/demo_loss.png)")
    d.set_defaults(func=_run_train_demo)

    p = subparsers.add_parser(
        "demo",
        help="train a small encoder-decoder to reverse sequences (about a minute)",
        description="Train a small encoder-decoder (2+2 layers, d_model 64) on a built-in task of digit sequences "
        "and report its exact-match accuracy on held-out sequences.",
    )
    p.add_argument(
        "--task",
        default="reverse",
        choices=DEMO_TASKS,
        help="default reverse (add trains with tformer train --task add: the examples print digits)",
    )
    add_train_flags(p, only=("steps", "batch_size", "lr", "seed"), defaults=SEQ2SEQ_DEMO)
    p.set_defaults(func=_run_demo)


def _errors(command: str, run) -> int:
    from tformer.training.checkpoint import CheckpointError
    from tformer.training.runtime import TrainingError

    try:
        return run()
    except (ValueError, FileNotFoundError, FileExistsError, CheckpointError) as err:
        print(f"tformer {command}: error: {err}", file=sys.stderr)
        return 2
    except TrainingError as err:
        print(f"tformer {command}: error: {err}", file=sys.stderr)
        return 1


def _run_train_demo(args: argparse.Namespace) -> int:
    return _errors("train-demo", lambda: _train_demo(args))


def _train_demo(args: argparse.Namespace) -> int:
    import shutil

    from tformer.cli.train import summary
    from tformer.training import demos
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.trainer import train

    # Every setting is checked before the stale run is removed and before training.
    if args.sample_tokens < 1:
        raise ValueError(f"--sample-tokens must be a positive integer; got {args.sample_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be a finite number > 0; got {args.temperature:g}")
    if args.plot_copy is not None and Path(args.plot_copy).is_dir():
        raise ValueError(f"--plot-copy {args.plot_copy} is a directory; give a file name such as demo_loss.png")
    given, _ = given_settings(args)
    cfg = demos.demo_config(args.out, given.get("steps", DEMO["steps"]), given.get("progress", True))
    cfg.validate()
    out = Path(args.out)
    demos.clear_demo_run(out, cfg)
    model = DEMO_MODEL
    print(
        f"training a {model['num_layers']}-layer GPT (d_model {model['d_model']}, context {cfg.block_size} bytes) on "
        f"the Python stdlib, {cfg.steps} steps; Ctrl-C stops and saves",
        flush=True,  # seen at once when stdout is a pipe or a file (make demo | tee)
    )
    start = time.perf_counter()
    result = train(cfg)
    print(summary(result))
    ckpt = load_checkpoint(out)
    text = demos.sample_text(ckpt.model, ckpt.tokenizer, args.prompt, args.sample_tokens, args.temperature)
    print(f"\nsample (temperature {args.temperature}, prompt {args.prompt!r}):\n{'-' * 60}\n{text}\n{'-' * 60}")
    print(f"total {time.perf_counter() - start:.0f} s; loss plot: {out / 'loss.png'}")
    if args.plot_copy and (out / "loss.png").exists():
        Path(args.plot_copy).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "loss.png", args.plot_copy)
    return EXIT_INTERRUPTED if result.interrupted else 0


def _run_demo(args: argparse.Namespace) -> int:
    def run() -> int:
        from tformer.training import demos

        given, _ = given_settings(args)
        settings = dict(SEQ2SEQ_DEMO)
        settings.update({k: v for k, v in given.items() if k in settings})
        demos.reverse_config(args.task, **settings).validate()  # every flag, before a minute of training
        result = demos.run_demo(task=args.task, **settings)
        print(demos.format_result(result))
        return 0

    return _errors("demo", run)
