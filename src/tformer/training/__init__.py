"""Training: ``train(TrainConfig) -> TrainResult`` and everything a run needs.

Modules, in the order a run uses them:
    config      TrainConfig (every setting of a run: its type, default, check and flag), TrainResult
    settings    how a setting is described once (the field metadata behind TrainConfig and its flags)
    runtime     the process: devices, ranks under torchrun, Ctrl-C
    rundir      the run directory's lock, and the clean-up of a run that fails before its first step
    corpus      text corpora and the memory-mapped token cache
    tokenizers  byte / char / BPE tokenizers saved as one JSON file
    tasks       the built-in seq2seq tasks; pairs: source<TAB>target files
    batches     batches as pure functions of (seed, index); datasets: a run's tokenizer, batches and held-out set
    optim       the learning-rate schedule, AdamW's groups, per-step seeds, autocast
    losses      the training and validation losses, exact match of seq2seq decodes
    trainer     the training loop
    checkpoint  atomic, verified checkpoints; resume: which checkpoint a run continues, and whether it fits
    metrics     metrics.jsonl and the loss plot
    demos       the two demos (``make demo``'s language model and ``tformer demo``'s sequence reversal)
"""

from tformer.training.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from tformer.training.config import TrainConfig, TrainResult
from tformer.training.rundir import run_lock
from tformer.training.runtime import TrainingError
from tformer.training.trainer import train

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
