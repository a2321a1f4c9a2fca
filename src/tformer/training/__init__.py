"""Training: ``train(TrainConfig) -> TrainResult`` and everything a run needs.

Modules, in the order a run uses them:
    config      TrainConfig (every setting of a run: its type, default, check and flag), TrainResult
    settings    how a setting is described once (the field metadata behind TrainConfig and its flags)
    presets     the demos' settings (data only: the command line reads them without importing torch)
    runtime     the process: ranks under torchrun, Ctrl-C
    rundir      the run directory's lock, and the clean-up of a run that fails before its first step
    corpus      text corpora and the memory-mapped token cache (the tokenizers: :mod:`tformer.tokenizers`)
    tasks       the built-in seq2seq tasks; pairs: source<TAB>target files
    batches     batches as pure functions of (seed, index); datasets: a run's tokenizer, batches and held-out set
    optim       the learning-rate schedule, AdamW's groups, per-step seeds, autocast
    losses      the training and validation losses, exact match of seq2seq decodes
    trainer     the training loop
    finetune    a run that starts from another model (``init_from``: a run, a Hugging Face folder, a GGUF file)
    checkpoint  atomic, verified checkpoints; resume: which checkpoint a run continues, and whether it fits
    metrics     metrics.jsonl and the loss plot
    demos       the two demos (``make demo``'s language model and ``tformer demo``'s sequence reversal)

The names below are imported on first use (PEP 562 ``__getattr__``), as :mod:`tformer`'s are: importing
``tformer.training.config`` to build the ``tformer train`` flags does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it
_EXPORTS = {
    "Checkpoint": "tformer.training.checkpoint",
    "CheckpointError": "tformer.training.checkpoint",
    "load_checkpoint": "tformer.training.checkpoint",
    "TrainConfig": "tformer.training.config",
    "TrainResult": "tformer.training.config",
    "run_lock": "tformer.training.rundir",
    "TrainingError": "tformer.training.runtime",
    "train": "tformer.training.trainer",
}

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "TrainConfig",
    "TrainResult",
    "TrainingError",
    "load_checkpoint",
    "run_lock",
    "train",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tformer.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from tformer.training.checkpoint import Checkpoint, CheckpointError, load_checkpoint
    from tformer.training.config import TrainConfig, TrainResult
    from tformer.training.rundir import run_lock
    from tformer.training.runtime import TrainingError
    from tformer.training.trainer import train
