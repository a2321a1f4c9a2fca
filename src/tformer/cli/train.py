"""``tformer train`` and ``tformer train-demo``: thin skins over :func:`tformer.training.train`.

``tformer train --out DIR [--data PATH | --task NAME | --pairs FILE] ...`` trains (or with ``--resume``
continues) a run; ``torchrun --nproc_per_node=2 -m tformer train ...`` trains data-parallel.
``tformer train-demo`` is the main job of ``make demo``: a small GPT on the Python standard library for about
three minutes, then its validation loss, a sample and the loss plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, get_args

from tformer.config import Activation, AttnBackend, Position
from tformer.training.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST,
    CheckpointError,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
)
from tformer.training.config import MODEL_FLAGS as FLAG_OF_MODEL_FIELD
from tformer.training.runtime import LOCK_FILE

# argparse dest of a model flag -> TransformerConfig field: train_config.MODEL_FLAGS read backwards (--norm apart:
# it takes pre/post and sets norm_first)
MODEL_FLAGS = {flag[2:].replace("-", "_"): name for name, flag in FLAG_OF_MODEL_FIELD.items() if name != "norm_first"}
EXIT_INTERRUPTED = 130  # the shell's code for "stopped by SIGINT"
# Flags that do nothing in a kind of run, and why: given on the command line there, they are an error.
_TASK_TOKENIZER = "their tokenizer is the task's alphabet"
_WHOLE_EXAMPLES = "seq2seq models read whole examples, not --block-size windows"
_HELD_OUT = "seq2seq runs validate on all held-out examples"
DOES_NOT_APPLY = {
    "--task": {"tokenizer": _TASK_TOKENIZER, "vocab_size": _TASK_TOKENIZER, "unknown": _TASK_TOKENIZER,
               "block_size": _WHOLE_EXAMPLES, "eval_batches": _HELD_OUT,
               "val_fraction": "tasks hold out generated examples, not a share of a corpus",
               "cache_dir": "tasks generate their examples; nothing is tokenized into a cache"},
    "--pairs": {"block_size": _WHOLE_EXAMPLES, "eval_batches": _HELD_OUT,
                "task_max_len": "it sets the length of generated --task examples"},
    "--data": {"task_max_len": "it sets the length of generated --task examples",
               "label_smoothing": "only seq2seq (--task/--pairs) runs smooth their labels"},
}  # fmt: skip


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a language model (text) or a seq2seq model (task/pairs); --resume continues",
        description="Train or resume a model. Flags left out keep their defaults (or, with --resume, the saved "
        "run's values). Ctrl-C saves a checkpoint and stops; --resume continues exactly.",
    )
    S = argparse.SUPPRESS  # only the flags given on the command line reach the config
    p.add_argument("--out", required=True, help="run directory: checkpoints/, metrics.jsonl, loss.png")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", default=S, help="LM corpus: a text file or a folder of text files (default: stdlib)")
    src.add_argument("--task", default=S, help="seq2seq built-in task: reverse, sort, copy, add")
    src.add_argument("--pairs", default=S, help="seq2seq: a file of source<TAB>target lines")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--steps", type=int, default=S, help="total optimizer steps (default 1000)")
    p.add_argument("--stop-after", type=int, default=S, help="end this run after this step (schedule over --steps)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer", choices=["byte", "char", "bpe"], default=S, help="default byte")
    g.add_argument("--vocab-size", type=int, default=S, help="BPE vocabulary size (default 1024)")
    g.add_argument("--unknown", choices=["unk", "skip", "error"], default=S, help="char: unseen characters")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=S)
    g.add_argument("--layers", type=int, default=S)
    g.add_argument("--heads", type=int, default=S)
    g.add_argument("--kv-heads", type=int, default=S)
    g.add_argument("--d-ff", type=int, default=S)
    g.add_argument("--dropout", type=float, default=S)
    g.add_argument("--position", choices=get_args(Position), default=S)
    g.add_argument("--activation", choices=get_args(Activation), default=S)
    g.add_argument("--norm", choices=["pre", "post"], default=S, help="Pre-LN or Post-LN blocks")
    g.add_argument("--attn-backend", choices=get_args(AttnBackend), default=S)
    g.add_argument("--block-size", type=int, default=S, help="LM context length (default 128)")
    g = p.add_argument_group("optimization")
    for flag, kind, text in [
        ("--batch-size", int, "global sequences per step (default 32)"),
        ("--grad-accum", int, "micro-batches per step (default 1)"),
        ("--lr", float, "peak learning rate (default 1e-3)"),
        ("--min-lr", float, "final learning rate of the cosine (default 1e-4)"),
        ("--warmup", int, "linear warm-up steps (default 100)"),
        ("--weight-decay", float, "AdamW decay of the weight matrices (default 0.1)"),
        ("--grad-clip", float, "max gradient norm, 0 = off (default 1.0)"),
        ("--label-smoothing", float, "seq2seq (default 0.1)"),
        ("--seed", int, "(default 0)"),
    ]:
        g.add_argument(flag, type=kind, default=S, help=text)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=S,
                   help="autocast: auto = bfloat16 on CUDA, float32 on CPU")  # fmt: skip
    g.add_argument("--compile", action="store_true", default=S, help="torch.compile the model")
    g.add_argument("--device", default=S, help="auto, cpu, cuda, cuda:1 ...")
    g = p.add_argument_group("bookkeeping")
    g.add_argument("--eval-every", type=int, default=S, help="steps between validation losses (default 250)")
    g.add_argument("--eval-batches", type=int, default=S, help="LM validation batches (default 20)")
    g.add_argument("--save-every", type=int, default=S, help="steps between checkpoints (default 500)")
    g.add_argument("--keep", type=int, default=S, help="newest checkpoints kept, older ones deleted (default 2)")
    g.add_argument("--log-every", type=int, default=S, help="steps between progress/metrics updates (default 10)")
    g.add_argument("--val-fraction", type=float, default=S, help="held-out share of the data (default 0.1)")
    g.add_argument("--task-max-len", type=int, default=S, help="task: longest source (add: digits; default 16)")
    g.add_argument("--cache-dir", default=S, help="token cache (default $TFORMER_CACHE or ~/.cache/tformer)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_train)

    d = subparsers.add_parser("train-demo", help="the main job: a small GPT on the Python stdlib (~3 min on 2 cores)")
    d.add_argument("--out", default="runs/demo", help="run directory (default runs/demo; replaced each time)")
    d.add_argument("--steps", type=int, default=DEMO["steps"], help=f"optimizer steps (default {DEMO['steps']})")
    d.add_argument("--prompt", default="def ", help="the start of the sample")
    d.add_argument("--sample-tokens", type=int, default=400, help="bytes to sample (default 400)")
    d.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, > 0 (default 0.8)")
    d.add_argument("--plot-copy", default=None, help="also copy loss.png here (e.g. docs/demo_loss.png)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=_run_demo)


def config_from_args(args: argparse.Namespace):
    """The :class:`TrainConfig` the flags describe; with ``--resume`` the saved run's, updated by the flags."""
    from tformer.training.runtime import resolve_device, triton_interpreter
    from tformer.training.trainer import TrainConfig, damaged_checkpoint_error

    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("func", "command", "no_progress")}
    model = {MODEL_FLAGS[k]: given.pop(k) for k in list(given) if k in MODEL_FLAGS}
    if "norm" in given:
        model["norm_first"] = given.pop("norm") == "pre"
    base: dict[str, Any] = {}
    if args.resume:
        latest = find_latest(args.out)
        if latest is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {Path(args.out) / 'checkpoints'}; train without "
                                    "--resume first")  # fmt: skip
        try:
            base = read_manifest(latest)["train_config"]
        except CheckpointError as err:
            raise damaged_checkpoint_error(args.out, err) from None
        base.pop("stop_after", None)  # a time-box of the earlier run, not of this one
        if {"data", "task", "pairs"} & set(given):  # a new data source replaces the saved one (then checked)
            for source in ("data", "task", "pairs"):
                base.pop(source, None)
        _check_saved_config(base, set(given), latest / MANIFEST)
        saved_model = base.get("model", {})
        if saved_model.get("attn_backend") == "triton" and "attn_backend" not in model:
            device = resolve_device(given.get("device", base.get("device", "auto")))
            if device.type != "cuda" and not triton_interpreter():  # as load_checkpoint does: all backends are exact
                model["attn_backend"] = "auto"
    merged = {**base, **given, "model": {**base.get("model", {}), **model}, "progress": not args.no_progress}
    cfg = TrainConfig.from_dict(merged)
    _reject_flags_that_do_not_apply(cfg, set(given))
    return cfg


def _check_saved_config(saved: dict[str, Any], given: set[str], manifest: Path) -> None:
    """``CheckpointError`` naming the manifest and the field, for a saved ``train_config`` value that cannot be
    right (a hand-edited or damaged manifest): a wrong type, or a model that cannot be built. Values the command
    line replaces are not looked at."""
    from tformer.training.config import TrainConfig, field_type_error

    for name, value in saved.items():
        problem = None if name in given else field_type_error(name, value)
        if problem:
            raise CheckpointError(f"{manifest}: malformed train_config: {problem}")
    try:  # the saved model on its own, as when it was saved (model flags given now are checked with the run)
        TrainConfig.from_dict({**saved, "out": "."}).check_model()
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{manifest}: malformed train_config: model: {err}") from None


def _reject_flags_that_do_not_apply(cfg, given: set[str]) -> None:
    """``ValueError`` naming the flags given on the command line that this kind of run would silently ignore."""
    source = "--task" if cfg.task is not None else "--pairs" if cfg.pairs is not None else "--data"
    reasons = {name: why for name, why in DOES_NOT_APPLY[source].items() if name in given}
    if "vocab_size" in given and "vocab_size" not in reasons and cfg.tokenizer != "bpe":
        reasons["vocab_size"] = f"it sizes a BPE vocabulary and this run's tokenizer is {cfg.tokenizer}"
    if "unknown" in given and "unknown" not in reasons and cfg.tokenizer != "char":
        reasons["unknown"] = f"it is the char tokenizer's policy and this run's tokenizer is {cfg.tokenizer}"
    if reasons:
        run = f"{source} runs" if source != "--data" else "language-model (--data) runs"
        parts = []
        for why in dict.fromkeys(reasons.values()):  # one clause per reason, in the order of DOES_NOT_APPLY
            flags = [f"--{name.replace('_', '-')}" for name, w in reasons.items() if w == why]
            parts.append(f"{', '.join(flags)} {'does' if len(flags) == 1 else 'do'} not apply to {run} ({why})")
        raise ValueError("; ".join(parts) + ("; leave it out" if len(reasons) == 1 else "; leave them out"))


def _run_train(args: argparse.Namespace) -> int:
    from tformer.training.trainer import TrainingError, train

    try:
        cfg = config_from_args(args)
        result = train(cfg)
    except (ValueError, FileNotFoundError, FileExistsError, CheckpointError) as err:
        print(f"tformer train: error: {err}", file=sys.stderr)
        return 2
    except TrainingError as err:  # diverged, or another run holds --out
        print(f"tformer train: error: {err}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports
        return EXIT_INTERRUPTED if result.interrupted else 0
    print(_summary(result))
    if result.interrupted:
        print(f"interrupted at step {result.step}; checkpoint saved. Continue with: tformer train --out {cfg.out} "
              "--resume")  # fmt: skip
        return EXIT_INTERRUPTED
    return 0


def _summary(result) -> str:
    lines = [f"trained to step {result.step} in {result.seconds:.0f} s ({result.tokens_per_s:,.0f} tokens/s, "
             f"{result.num_parameters:,} parameters)"]  # fmt: skip
    if result.losses:
        lines.append(f"training loss {result.final_loss:.4f} (mean of the last 20 steps)")
    if result.val_losses:
        lines.append(f"validation loss {result.val_loss:.4f}")
    if result.val_accuracy is not None:
        lines.append(f"held-out exact match {100 * result.val_accuracy:.1f}%")
    lines.append(f"checkpoint {result.checkpoint}")
    lines.append(f"metrics {result.out / 'metrics.jsonl'}, loss plot {result.out / 'loss.png'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The demo (make demo)
# --------------------------------------------------------------------------------------------------
DEMO = dict(steps=1800, batch_size=16, block_size=128, lr=2e-3, min_lr=2e-4, warmup=100, eval_every=250,
            eval_batches=16, save_every=400, log_every=10)  # fmt: skip
DEMO_MODEL = dict(d_model=128, num_heads=4, num_layers=4, d_ff=512, dropout=0.0)


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
    """Prompt + ``max_new_tokens`` sampled tokens, decoded: one call of :func:`tformer.generation.sampling.generate` (key/value
    cache; a model with learned positions sees a sliding window of its last ``max_seq_len`` tokens). An empty
    prompt samples the start of a new document: the model is conditioned on the document separator of the
    training corpus (``tformer.training.data.DOC_SEPARATOR``), which is not part of the returned text. Deterministic for
    a given ``seed``."""
    from tformer.generation.sampling import generate
    from tformer.training.data import DOC_SEPARATOR

    if prompt:
        ids = tokenizer.encode(prompt)
        return tokenizer.decode(ids + generate(model, [ids], max_new_tokens=max_new_tokens, temperature=temperature,
                                               seed=seed)[0])  # fmt: skip
    try:  # an empty prompt: the start of a document, after the separator that precedes one in the corpus
        start = tokenizer.encode(DOC_SEPARATOR)
    except ValueError:
        start = []
    if not start:  # a char tokenizer built from a corpus without line breaks
        raise ValueError("the prompt is empty, and this tokenizer has no line break to start a document from; "
                         "give a non-empty --prompt")  # fmt: skip
    return tokenizer.decode(generate(model, [start], max_new_tokens=max_new_tokens, temperature=temperature,
                                     seed=seed)[0])  # fmt: skip


def _run_demo(args: argparse.Namespace) -> int:
    from tformer.training.trainer import TrainingError

    try:
        return _demo(args)
    except (ValueError, FileNotFoundError, FileExistsError, CheckpointError) as err:
        print(f"tformer train-demo: error: {err}", file=sys.stderr)
        return 2
    except TrainingError as err:
        print(f"tformer train-demo: error: {err}", file=sys.stderr)
        return 1


# The settings that make a run a train-demo run (its length, --steps, may differ).
DEMO_IDENTITY = ("data", "task", "pairs", "tokenizer", "model", "block_size", "val_fraction", "seed", "batch_size",
                 "grad_accum", "lr", "min_lr", "eval_every", "eval_batches", "save_every", "log_every")  # fmt: skip
RUN_FILES = (LOCK_FILE, "metrics.jsonl", "loss.png", CHECKPOINTS_DIR)  # what a run writes into OUT


def _check_demo_may_replace(out: Path, cfg) -> None:
    """``ValueError`` unless the existing folder ``out`` is empty or holds an earlier train-demo run: every
    checkpoint's manifest says ``kind`` "lm" and the demo's settings (``DEMO_IDENTITY``); without checkpoints, only
    the leftovers of a run that never saved one (``RUN_FILES``). The demo deletes nothing of any other run."""
    found = list_checkpoints(out / CHECKPOINTS_DIR)
    if not found:
        others = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES)
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise ValueError(f"--out {out} is not empty and holds no train-demo run ({len(others)} other "
                             f"{'entry' if len(others) == 1 else 'entries'}: {shown}); choose another --out or delete "
                             "it")  # fmt: skip
        return
    mine = cfg.to_dict()
    for checkpoint in found:
        try:
            manifest = json.loads((checkpoint / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            manifest = None
        if not isinstance(manifest, dict):
            manifest = {}
        saved = manifest.get("train_config")
        if not (manifest.get("kind") == "lm" and isinstance(saved, dict)
                and all(saved.get(k) == mine[k] for k in DEMO_IDENTITY)):  # fmt: skip
            kind = manifest.get("kind", "unknown")
            raise ValueError(f"--out {out} holds another run (kind {kind!r}, {len(found)} checkpoint"
                             f"{'s' if len(found) != 1 else ''}); train-demo only replaces its own runs: choose "
                             "another --out or delete it")  # fmt: skip


def _demo(args: argparse.Namespace) -> int:
    from tformer.training.trainer import TrainConfig, run_lock, train

    # Every setting is checked before the stale run is removed and before training.
    if args.sample_tokens < 1:
        raise ValueError(f"--sample-tokens must be a positive integer; got {args.sample_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be a finite number > 0; got {args.temperature:g}")
    if args.plot_copy is not None and Path(args.plot_copy).is_dir():
        raise ValueError(f"--plot-copy {args.plot_copy} is a directory; give a file name such as demo_loss.png")
    out = Path(args.out)
    settings = {**DEMO, "steps": args.steps, "warmup": min(DEMO["warmup"], max(1, args.steps // 10))}
    cfg = TrainConfig(out=str(out), model=dict(DEMO_MODEL), progress=not args.no_progress, **settings)
    cfg.validate()
    if out.exists():  # (a missing OUT is left to train(), which removes it again if the run fails early)
        _check_demo_may_replace(out, cfg)  # before the lock, whose .lock file would stay in a folder that is not ours
        with run_lock(out):  # fails at once if another run is writing there; train() takes the lock again
            _check_demo_may_replace(out, cfg)  # again: the folder is ours only now
            for stale in (out / CHECKPOINTS_DIR, out / "metrics.jsonl", out / "loss.png"):  # the demo starts afresh
                if stale.is_dir():
                    shutil.rmtree(stale)
                elif stale.exists():
                    stale.unlink()
    print(
        f"training a {DEMO_MODEL['num_layers']}-layer GPT (d_model {DEMO_MODEL['d_model']}, "
        f"context {cfg.block_size} bytes) on the Python stdlib, {cfg.steps} steps; Ctrl-C stops and saves"
    )
    start = time.perf_counter()
    result = train(cfg)
    print(_summary(result))
    ckpt = load_checkpoint(out)
    text = sample_text(ckpt.model, ckpt.tokenizer, args.prompt, args.sample_tokens, args.temperature)
    print(f"\nsample (temperature {args.temperature}, prompt {args.prompt!r}):\n{'-' * 60}\n{text}\n{'-' * 60}")
    print(f"total {time.perf_counter() - start:.0f} s; loss plot: {out / 'loss.png'}")
    if args.plot_copy and (out / "loss.png").exists():
        Path(args.plot_copy).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "loss.png", args.plot_copy)
    return EXIT_INTERRUPTED if result.interrupted else 0
