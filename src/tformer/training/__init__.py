"""Training: ``train(TrainConfig) -> TrainResult`` and everything a run needs.

Modules, in the order a run uses them:
    config      TrainConfig (every setting of a run, typed and validated), TrainResult, the default models
    runtime     the process: devices, ranks under torchrun, the run lock, Ctrl-C
    data        corpora, the memory-mapped token cache, batches
    tokenizers  byte / char / BPE tokenizers saved as one JSON file
    tasks       the built-in seq2seq tasks and source<TAB>target pair files
    trainer     the training loop
    checkpoint  atomic, verified checkpoints and exact resume
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
