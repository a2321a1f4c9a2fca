"""``tformer train``: a thin skin over :func:`tformer.training.train`.

``tformer train --out DIR [--data PATH | --task NAME | --pairs FILE] ...`` trains (or with ``--resume``
continues) a run; ``torchrun --nproc_per_node=2 -m tformer train ...`` trains data-parallel. Every flag is a
:class:`~tformer.training.TrainConfig` field (:mod:`tformer.cli.flags`); flags left out keep their defaults or, with
``--resume``, the saved run's values.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from tformer.cli.flags import add_train_flags, flag_of_setting, given_settings

EXIT_INTERRUPTED = 130  # the shell's code for "stopped by SIGINT"


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a language model (text) or a seq2seq model (task/pairs); --resume continues",
        description="Train or resume a model. Flags left out keep their defaults (or, with --resume, the saved "
        "run's values). Ctrl-C saves a checkpoint and stops; --resume continues exactly.",
    )
    add_train_flags(p)
    p.set_defaults(func=_run_train)


def config_from_args(args: argparse.Namespace):
    """The :class:`TrainConfig` the flags describe; with ``--resume`` the saved run's, updated by the flags."""
    from tformer.training.config import MODEL_FLAGS, TrainConfig

    given, model = given_settings(args)
    base = _saved_settings(given, model) if given.get("resume") else {}
    cfg = TrainConfig.from_dict({**base, **given, "model": {**base.get("model", {}), **model}})
    reject_flags_that_do_not_apply(cfg, set(given))
    if base and int(os.environ.get("RANK", "0")) == 0:  # a resumed run the flags change: say so (rank 0)
        saved = TrainConfig.from_dict({**base, "out": cfg.out})
        changed = {
            flag_of_setting(name): (getattr(cfg, name), getattr(saved, name))
            for name in sorted(set(given) & set(base) - {"out", "resume", "progress"})
        }
        if "attn_backend" in model:  # the one model flag a resume may change (all backends are exact)
            before = base.get("model", {}).get("attn_backend", "auto")
            changed[MODEL_FLAGS["attn_backend"].flag] = (model["attn_backend"], before)
        for flag, (now, before) in changed.items():
            if now != before:
                had = _shown(flag, before) if isinstance(before, bool) else _value(before)
                print(f"note: --resume with {_shown(flag, now)} (the run had {had})", file=sys.stderr)
    return cfg


def _shown(flag: str, value: Any) -> str:
    """A setting as its flag sets it (``--betas 0.9 0.99``, ``--lr 0.001``, ``--no-compile``)."""
    if isinstance(value, bool):
        name = flag.removeprefix("--").removeprefix("no-")
        return f"--{name}" if value else f"--no-{name}"
    return f"{flag} {_value(value)}"


def _value(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _saved_settings(given: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """The ``train_config`` of the run in ``--out``, without what the flags given now replace."""
    from tformer.runtime import resolve_device
    from tformer.training.checkpoint import CheckpointError, find_latest, read_manifest
    from tformer.training.resume import damaged_checkpoint_error
    from tformer.training.rundir import writer_of
    from tformer.training.runtime import TrainingError, triton_interpreter

    out = given["out"]
    latest = find_latest(out)
    if latest is None:
        pid = writer_of(out)
        if pid is not None:  # a run that has not saved its first checkpoint yet
            raise TrainingError(
                f"--resume: another tformer run is writing to {out} (pid {pid}) and has saved no checkpoint yet; "
                "wait for it to save one (or to end), or choose another --out"
            )
        raise FileNotFoundError(f"--resume: no checkpoint in {Path(out) / 'checkpoints'}; train without --resume first")
    try:
        manifest = read_manifest(latest)
    except CheckpointError as err:
        raise damaged_checkpoint_error(out, err) from None
    base = manifest["train_config"]
    base.pop("stop_after", None)  # a time-box of the earlier run, not of this one
    new = [source for source in ("data", "task", "pairs") if source in given]
    if new and (new[0] == "data") != (manifest.get("kind") == "lm"):  # before its settings read as misplaced
        kinds = {"lm": "a language-model run (--data)", "seq2seq": "a seq2seq run (--task or --pairs)"}
        raise ValueError(
            f"--resume: {out} holds {kinds.get(manifest.get('kind'), 'another kind of run')}, and --{new[0]} trains "
            "the other kind; resume it with its own kind of data, or train into another --out"
        )
    if new:  # a new data source replaces the saved one (then checked)
        for source in ("data", "task", "pairs"):
            base.pop(source, None)
    _check_saved_config(base, set(given), latest / "checkpoint.json")
    if base.get("model", {}).get("attn_backend") == "triton" and "attn_backend" not in model:
        device = resolve_device(given.get("device", base.get("device", "auto")))
        if device.type != "cuda" and not triton_interpreter():  # as load_checkpoint does: all backends are exact
            model["attn_backend"] = "auto"
    return base


def _check_saved_config(saved: dict[str, Any], given: set[str], manifest: Path) -> None:
    """``CheckpointError`` naming the manifest and the field, for a saved ``train_config`` value that cannot be
    right (a hand-edited or damaged manifest): a wrong type, or a model that cannot be built. Values the command
    line replaces are not looked at."""
    from tformer.training.checkpoint import CheckpointError
    from tformer.training.config import TrainConfig, check_saved_value

    for name, value in saved.items():
        problem = None if name in given else check_saved_value(name, value)
        if problem:
            raise CheckpointError(f"{manifest}: malformed train_config: {problem}")
    try:  # the saved model on its own, as when it was saved (model flags given now are checked with the run)
        TrainConfig.from_dict({**saved, "out": "."}).check_model()
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{manifest}: malformed train_config: model: {err}") from None


def reject_flags_that_do_not_apply(cfg, given: set[str]) -> None:
    """``ValueError`` naming the flags given on the command line that this kind of run would silently ignore (even
    at their default values: a flag given is a flag meant)."""
    from tformer.training.config import runs_of, settings_that_do_not_apply
    from tformer.training.finetune import TOKENIZER_SETTINGS, tokenizer_refusal

    tokenizer_settings = [name for name in TOKENIZER_SETTINGS if name in given]
    if cfg.init_from is not None and tokenizer_settings:  # given at all, even at its default: the model's is used
        raise ValueError(tokenizer_refusal(tokenizer_settings))
    reasons = settings_that_do_not_apply(cfg, given)
    if not reasons:
        return
    parts = []
    for why in dict.fromkeys(reasons.values()):  # one clause per reason, in the order of the fields
        flags = [flag_of_setting(name) for name, w in reasons.items() if w == why]
        parts.append(f"{', '.join(flags)} {'does' if len(flags) == 1 else 'do'} not apply to {runs_of(cfg)} ({why})")
    raise ValueError("; ".join(parts) + ("; leave it out" if len(reasons) == 1 else "; leave them out"))


def _run_train(args: argparse.Namespace) -> int:
    from tformer.training.checkpoint import CheckpointError
    from tformer.training.runtime import TrainingError
    from tformer.training.trainer import train

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
    print(summary(result))
    if result.interrupted:
        print(
            f"interrupted at step {result.step}; checkpoint saved. Continue with: tformer train --out {cfg.out} "
            "--resume"
        )
        return EXIT_INTERRUPTED
    return 0


def summary(result) -> str:
    """What ``tformer train`` prints at the end of a run."""
    lines = [
        f"trained to step {result.step} in {result.seconds:.0f} s ({result.tokens_per_s:,.0f} tokens/s while "
        f"training, {result.num_parameters:,} parameters)"
    ]
    if result.losses:
        last = min(20, len(result.losses))
        smoothed = f", label smoothing {result.label_smoothing:g}" if result.label_smoothing else ""
        lines.append(
            f"training loss {result.final_loss:.4f} (mean of the last {last} step{'s' if last > 1 else ''}{smoothed})"
        )
    if result.val_losses:
        evaluated = max(result.val_losses)
        at = "" if evaluated == result.step else f" (at step {evaluated}, the last evaluation)"
        lines.append(f"validation loss {result.val_loss:.4f}{at}")
    if result.val_accuracy is not None:
        seen, also = result.trained_held_out, ""
        if seen:
            also = f" ({seen} held-out examples have sources too short to keep out of training: it may have seen them)"
        lines.append(f"held-out exact match {100 * result.val_accuracy:.1f}%{also}")
    lines.append(f"checkpoint {result.checkpoint}")
    lines.append(f"metrics {result.out / 'metrics.jsonl'}, loss plot {result.out / 'loss.png'}")
    return "\n".join(lines)
