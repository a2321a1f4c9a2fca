"""Resuming a run (``--resume``): its newest checkpoint, whether it fits this run's settings, and the error for a
damaged one, naming the newest earlier checkpoint that verifies (nothing is deleted). Loading a run to use it
(``sample``, ``explore``, ...) gives the same hint: :func:`load_newest`."""

from __future__ import annotations

import os
from pathlib import Path

from tformer.config import ConfigError
from tformer.training.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST,
    STATE,
    Checkpoint,
    CheckpointError,
    find_latest,
    last_good_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
)
from tformer.training.config import STRUCTURAL, TrainConfig
from tformer.training.metrics import PLOT_FILE
from tformer.training.rundir import METRICS_FILE

RUN_OUTPUTS = (METRICS_FILE, PLOT_FILE)  # what a run writes into OUT besides its checkpoints and lock


def damaged_checkpoint_error(out: str | os.PathLike, err: CheckpointError) -> CheckpointError:
    """The error for a latest checkpoint of run ``out`` that fails to load with ``err``."""
    found = list_checkpoints(Path(out) / CHECKPOINTS_DIR)
    if not found:
        return err
    good = last_good_checkpoint(found[:-1])
    hint = (
        f"delete it to resume from {good.name}"
        if good is not None
        else "no earlier checkpoint verifies; train without --resume into another --out"
    )
    return CheckpointError(f"checkpoint {found[-1].name} is damaged ({err}); {hint}")


def load_newest(path: str | os.PathLike, **kwargs) -> Checkpoint:
    """:func:`load_checkpoint` (``kwargs`` are its own), except that when ``path`` is a run whose newest checkpoint
    fails to load, the ``CheckpointError`` also names the newest earlier checkpoint that verifies, to load instead
    (``--checkpoint``): the one hint ``sample``, ``translate``, ``explore`` and ``convert`` give alike."""
    try:
        return load_checkpoint(path, **kwargs)
    except CheckpointError as err:
        raise damaged_newest_error(path, err) from err


def damaged_newest_error(path: str | os.PathLike, err: CheckpointError) -> CheckpointError:
    """For ``path`` a run directory (or its ``checkpoints`` folder) whose newest checkpoint failed to load with
    ``err``: an error that also names the newest earlier checkpoint that verifies. ``err`` itself for a specific
    checkpoint directory (the user chose it: there is nothing to fall back to), or when there is no earlier one."""
    root = Path(path)
    if (root / MANIFEST).exists():
        return err
    found = list_checkpoints(root / CHECKPOINTS_DIR) or list_checkpoints(root)  # as load_checkpoint looks
    if not found:
        return err
    older = last_good_checkpoint(found[:-1])
    if older is not None:
        return CheckpointError(
            f"the newest checkpoint {found[-1]} is damaged ({err}); delete it, or pass --checkpoint {older}"
        )
    return CheckpointError(
        f"the newest checkpoint {found[-1]} is damaged ({err}); no earlier checkpoint of {path} verifies"
    )


def _weights_only(checkpoint: Path) -> bool:
    """Whether ``checkpoint``'s manifest lists no trainer state (a converted model: weights alone, by design); a
    manifest that cannot be read is for the load to report."""
    try:
        return STATE not in read_manifest(checkpoint)["files"]
    except (CheckpointError, KeyError, TypeError):
        return False


def checkpoint_to_resume(cfg: TrainConfig) -> Checkpoint | None:
    """The checkpoint this run continues (``None`` for a fresh run); errors for a run that cannot start: a fresh run
    into an ``OUT`` that holds checkpoints, a resume without one, a damaged one, or one of other settings."""
    if cfg.out is None:
        return None
    latest = find_latest(cfg.out)
    if not cfg.resume:
        if latest is not None:
            raise FileExistsError(
                f"{cfg.out} already holds checkpoints (latest {latest.name}); pass --resume to "
                "continue that run, or choose another --out"
            )
        outputs = [Path(cfg.out) / name for name in RUN_OUTPUTS]
        written = [path.name for path in outputs if path.is_file() and path.stat().st_size]
        if written:
            raise FileExistsError(
                f"{cfg.out} holds {' and '.join(written)} of a run that saved no checkpoint (or files of that name), "
                "which this run would overwrite; delete them, or choose another --out"
            )
        return None
    if latest is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint in {Path(cfg.out) / CHECKPOINTS_DIR}; train without --resume first"
        )
    if _weights_only(latest):
        raise CheckpointError(
            f"--resume: {latest} holds weights only (no optimizer state; e.g. written by tformer convert): there is "
            f"no training run to continue; to train the model further, start a run from it (--init-from {cfg.out})"
        )
    try:  # on this run's attention backend: all are exact, so a run may continue on another one
        ckpt = load_checkpoint(cfg.out, with_state=True, attn_backend=cfg.model.get("attn_backend", "auto"))
    except CheckpointError as err:
        raise damaged_checkpoint_error(cfg.out, err) from None
    check_resumable(cfg, ckpt)
    return ckpt


def check_resumable(cfg: TrainConfig, ckpt: Checkpoint) -> None:
    """``ValueError`` unless ``ckpt`` was saved by a run of the same model, data and batches as ``cfg``."""
    if ckpt.kind != cfg.kind:
        raise ValueError(
            f"the checkpoint in {cfg.out} is a {ckpt.kind!r} model but this run trains a {cfg.kind!r} "
            "one; resume with the same --data/--task/--pairs or train into another --out"
        )
    saved = dict(ckpt.train_config)
    for name in ("data", "pairs"):  # runs saved before paths were made absolute
        if isinstance(saved.get(name), str):
            saved[name] = os.path.abspath(saved[name])
    now = {k: getattr(cfg, k) for k in STRUCTURAL}
    for settings in (saved, now):  # the attention backend does not change the weights: every backend is exact
        if isinstance(settings.get("model"), dict):
            settings["model"] = {k: v for k, v in settings["model"].items() if k != "attn_backend"}
    diffs = [f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in STRUCTURAL if saved.get(k) != now[k]]
    if diffs:
        raise ValueError(f"cannot resume {ckpt.path}: these settings differ from the saved run: {'; '.join(diffs)}")
    if ckpt.step >= cfg.steps:
        raise ValueError(
            f"the checkpoint is already at step {ckpt.step} >= steps={cfg.steps}; raise --steps to train further"
        )
    end = cfg.stop_after if cfg.stop_after is not None else cfg.steps
    if end <= ckpt.step:
        raise ValueError(f"stop_after={end} is not after the checkpoint's step {ckpt.step}; nothing to train")


def check_same_data(cfg: TrainConfig, ckpt: Checkpoint, digest: str | None) -> None:
    """``ValueError`` when the data a resumed run would train on is not what its checkpoint was trained on: the
    same ``--data``/``--pairs`` path (:func:`check_resumable`) whose files were edited, added or removed since. The
    token ids are compared (their SHA-256, ``digest``), so a file touched but not changed still resumes.
    Checkpoints written before the digest was saved are not checked."""
    saved = ckpt.train_config.get("data_digest")
    if saved is None or digest is None or saved == digest:
        return
    source = f"--data {cfg.data}" if cfg.data is not None else f"--pairs {cfg.pairs}"
    fresh = (  # --init-from starts language-model runs only
        f"start a new run from these weights into another --out (--init-from {cfg.out})"
        if cfg.kind == "lm"
        else "train a new run into another --out"
    )
    raise ValueError(
        f"cannot resume {ckpt.path}: {source} holds other text than the run trained on (its token ids differ from "
        f"the saved run's: files were edited, added or removed since); restore the data as it was, or {fresh}"
    )


def check_out_outside_data(cfg: TrainConfig) -> None:
    """``ConfigError`` for an ``--out`` inside the ``--data`` folder where the corpus scan would read it: the run's
    own files (``metrics.jsonl``, checkpoints, tokenizers) would become training text, and on ``--resume`` other
    text than the run started with. A hidden folder (``.runs/``) is skipped by the scan, so it may hold runs."""
    if cfg.out is None or cfg.data is None or not Path(cfg.data).is_dir():
        return
    data, out = Path(cfg.data).resolve(), Path(cfg.out).resolve()
    if out.is_relative_to(data) and not any(part.startswith(".") for part in out.relative_to(data).parts):
        raise ConfigError(
            f"--out {cfg.out} is inside --data {cfg.data}: the run's own files (checkpoints, metrics.jsonl) would be "
            "read as training text; choose an --out outside the data folder (or a hidden folder in it, which the "
            "corpus scan skips)",
            "out",
            "data",
        )
