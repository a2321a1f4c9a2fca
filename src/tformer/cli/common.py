"""What the commands that load a checkpoint share: loading it (and naming a good older one when the newest is
damaged), and turning bad input into one line on stderr with exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def load_run(path: str, kind: str, device: str, command: str):
    """The checkpoint at ``path`` (a checkpoint or a run directory) on ``device``, which must hold a ``kind`` model."""
    from tformer.training.checkpoint import CheckpointError, load_checkpoint
    from tformer.training.runtime import resolve_device

    try:
        ckpt = load_checkpoint(path, map_location=resolve_device(device))
    except CheckpointError as err:
        raise _damaged_latest_error(path, err) from err
    if ckpt.kind != kind:
        other = "translate" if kind == "lm" else "sample"
        raise ValueError(
            f"{ckpt.path} holds a {ckpt.kind!r} model; `tformer {command}` needs {kind!r} (use `tformer {other}`)"
        )
    return ckpt


def _damaged_latest_error(path: str, err: Exception) -> Exception:
    """For ``path`` a run directory (or its ``checkpoints`` folder) whose newest checkpoint failed to load with
    ``err``: an error that also names the newest earlier checkpoint that verifies, to pass as --checkpoint.
    ``err`` itself for a specific checkpoint directory, or when there is no earlier one."""
    from tformer.training.checkpoint import (
        CHECKPOINTS_DIR,
        MANIFEST,
        CheckpointError,
        last_good_checkpoint,
        list_checkpoints,
    )

    root = Path(path)
    if (root / MANIFEST).exists():  # a specific checkpoint: the user chose it, there is nothing to fall back to
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


def report_errors(command: str, run: Callable[[], int]) -> int:
    """``run()``, or exit code 2 with one line on stderr for a bad setting or checkpoint."""
    from tformer.training.checkpoint import CheckpointError

    try:
        return run()
    except (ValueError, CheckpointError) as err:
        print(f"tformer {command}: error: {err}", file=sys.stderr)
        return 2
