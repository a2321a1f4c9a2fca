"""Training: ``train(TrainConfig) -> TrainResult`` for decoder-only LMs and encoder-decoder models.

One optimizer step (``B`` sequences, the *global* batch, over all processes and micro-steps)::

    lr      = warmup then cosine:  lr * (s+1)/warmup  for s < warmup,
              min_lr + (lr - min_lr) * (1 + cos(pi * (s - warmup)/(steps - warmup))) / 2  after
    loss    = sum of token cross-entropies / (target tokens in the global batch)   (seq2seq: label smoothing)
    grads   = accumulated over ``grad_accum`` micro-batches (DDP all-reduces only on the last: ``no_sync``)
    clip    ||g||_2 <= grad_clip, then AdamW

AdamW weight decay applies to every parameter with ``dim >= 2`` (the weight matrices, including the token and
position embedding tables, as GPT-2/nanoGPT); biases and LayerNorm gains/shifts (``dim < 2``) are not decayed.

Exact resume. Everything a step depends on is either restored or a pure function of ``(seed, step)``: weights
and AdamW moments (checkpoint), the learning rate (step), the batch (``data.LMBatches.get(step)``), the dropout
masks (the torch RNG is re-seeded from ``(seed, step, rank)`` before each step). So ``k`` steps, stop, resume,
``N - k`` steps give bitwise the losses of ``N`` straight steps on the CPU in float32.

Data parallel. Under ``torchrun`` (``WORLD_SIZE > 1``) the model is wrapped in ``DistributedDataParallel``
(gloo on CPU, NCCL on CUDA). Every rank draws the same global batch and trains on its own rows; rank 0 alone
writes checkpoints, metrics and plots. The loss is normalized by the global token count, and DDP averages
gradients over ranks, so the update equals the one-process update up to floating-point summation order.

Files under ``OUT``: ``checkpoints/step-N/`` (see :mod:`tformer.checkpoint`), ``metrics.jsonl`` (one JSON
record per log or evaluation event), ``loss.png`` (written at the end and on interruption), ``.lock`` (held by the
run writing to ``OUT``, so that a second one fails at once instead of clobbering it). Settings are all checked
before ``OUT`` is created; a run that still fails before it logs a step (data too short for ``block_size``,
Ctrl-C while tokenizing) removes the ``OUT`` it created, and nothing else.

Divergence. The losses are read back from the device once per log interval (and before each checkpoint); a loss
that is not finite stops the run with :class:`TrainingError` before a checkpoint of the broken weights is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpoint,
    CheckpointError,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    model_class,
    read_manifest,
    save_checkpoint,
    unwrap,
)
from tformer.config import TransformerConfig
from tformer.data import (
    CorpusScan,
    LMBatches,
    Seq2SeqBatches,
    default_cache_dir,
    evaluation_batches,
    files_fingerprint,
    iter_texts,
    scan_corpus,
    split_pairs,
    tokenize_corpus,
)
from tformer.plots import plot_loss, read_metrics
from tformer.runtime import (
    LOCK_FILE,
    StopFlag,
    TrainingError,
    World,
    all_ranks_agree,
    init_world,
    resolve_device,
    rng_state,
    run_lock,
    set_rng_state,
    triton_interpreter,
)
from tformer.seq2seq import greedy_seq2seq
from tformer.tasks import TASKS, SequenceTask, check_pairs_file, load_pairs
from tformer.tokenization import SEQ2SEQ_SPECIALS, CharTokenizer, Tokenizer, build_tokenizer, tokenizer_from_dict

Dtype = Literal["auto", "float32", "bfloat16"]

LM_MODEL = dict(d_model=128, num_heads=4, num_layers=4, d_ff=512, dropout=0.0, position="learned",
                activation="gelu", norm_first=True, tie_embeddings=True)  # fmt: skip
SEQ2SEQ_MODEL = dict(d_model=128, num_heads=4, num_layers=2, d_ff=512, dropout=0.0, position="sinusoidal",
                     activation="relu", norm_first=True, tie_embeddings=True)  # fmt: skip
# Settings that define the model and its data: a resumed run must keep them.
STRUCTURAL = ("data", "task", "pairs", "tokenizer", "vocab_size", "unknown", "val_fraction", "model", "block_size",
              "task_min_len", "task_max_len", "task_held_out", "batch_size", "seed")  # fmt: skip
# TrainConfig fields that `tformer train` has no flag for (the Python API sets them); any other field is --field-name.
NO_FLAG = ("model", "betas", "task_min_len", "task_held_out", "progress")
# TransformerConfig field -> the `tformer train` flag that sets it (in error messages)
MODEL_FLAGS = {"d_model": "--d-model", "num_layers": "--layers", "num_heads": "--heads", "num_kv_heads": "--kv-heads",
               "d_ff": "--d-ff", "dropout": "--dropout", "position": "--position", "activation": "--activation",
               "norm_first": "--norm", "attn_backend": "--attn-backend"}  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _or_none(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


# The type of every TrainConfig field: (check, what it must be). Checked first by validate(), and on the train_config
# of a checkpoint before --resume builds on it (a hand-edited manifest must not end in a TypeError deep inside).
FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "out": (_is_str, "a path"),
    **dict.fromkeys(("data", "pairs", "cache_dir"), (_or_none(_is_str), "a path")),
    "task": (_or_none(_is_str), "a task name"),
    **dict.fromkeys(("tokenizer", "unknown", "dtype", "device"), (_is_str, "a string")),
    "model": (lambda value: isinstance(value, dict), "a dict of TransformerConfig fields"),
    **dict.fromkeys(("vocab_size", "block_size", "task_min_len", "task_max_len", "task_held_out", "steps", "batch_size",
                     "grad_accum", "warmup", "eval_every", "eval_batches", "save_every", "keep", "log_every", "seed"),
                    (_is_int, "an integer")),
    "stop_after": (_or_none(_is_int), "an integer"),
    **dict.fromkeys(("val_fraction", "lr", "min_lr", "weight_decay", "grad_clip", "label_smoothing"),
                    (_is_number, "a number")),
    "betas": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(map(_is_number, v)), "two numbers"),
    **dict.fromkeys(("compile", "resume", "progress"), (lambda value: isinstance(value, bool), "true or false")),
}  # fmt: skip


def flag_of(name: str) -> str:
    """``" (--name)"``: the flag of the TrainConfig field ``name``, for error messages; ``""`` if it has none."""
    return "" if name in NO_FLAG else f" (--{name.replace('_', '-')})"


def field_type_error(name: str, value: Any) -> str | None:
    """What is wrong with the type of ``value`` for the TrainConfig field ``name`` (``None``: nothing, or not a
    field), e.g. ``"betas must be two numbers; got 5"``."""
    check, expected = FIELD_TYPES.get(name, (lambda value: True, ""))
    return None if check(value) else f"{name} must be {expected}{flag_of(name)}; got {value!r}"


@dataclass
class TrainConfig:
    """What to train, on what, and how. Exactly one of ``data`` / ``task`` / ``pairs`` (none: the stdlib LM).

    ``model`` overrides fields of the default model of the kind (``LM_MODEL`` / ``SEQ2SEQ_MODEL``);
    ``vocab_size`` and ``pad_id`` always come from the tokenizer. ``batch_size`` is the global batch per
    optimizer step; it must split evenly into ``world_size * grad_accum`` micro-batches.
    """

    out: str
    data: str | None = None  # LM: a text file or folder; None (and no task/pairs) = the Python stdlib
    task: str | None = None  # seq2seq: a built-in task of tformer.tasks
    pairs: str | None = None  # seq2seq: a source<TAB>target file
    tokenizer: Literal["byte", "char", "bpe"] = "byte"
    vocab_size: int = 1024  # BPE only
    unknown: Literal["unk", "skip", "error"] = "unk"  # char only
    val_fraction: float = 0.1
    cache_dir: str | None = None
    model: dict[str, Any] = field(default_factory=dict)
    block_size: int = 128  # LM context length
    task_min_len: int = 1
    task_max_len: int = 16
    task_held_out: int = 500
    steps: int = 1000
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    label_smoothing: float = 0.1  # seq2seq only
    eval_every: int = 250
    eval_batches: int = 20
    save_every: int = 500
    keep: int = 2
    log_every: int = 10
    dtype: Dtype = "auto"
    compile: bool = False
    device: str = "auto"
    seed: int = 0
    resume: bool = False
    stop_after: int | None = None  # end this run after this step (with a checkpoint), schedule still over `steps`
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("out", "data", "pairs", "cache_dir"):  # paths are kept as strings (JSON in checkpoints)
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        for name in ("data", "pairs", "cache_dir"):  # absolute, so that --resume works from any directory
            if isinstance(getattr(self, name), str):
                setattr(self, name, os.path.abspath(os.path.expanduser(getattr(self, name))))
        if isinstance(self.betas, list):  # JSON has no tuples
            self.betas = tuple(self.betas)

    @property
    def kind(self) -> Literal["lm", "seq2seq"]:
        return "lm" if self.task is None and self.pairs is None else "seq2seq"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad setting, its flag and what would be valid: every setting, the model's
        included, is checked here, before any run directory is created or any data is read."""
        for f in dataclasses.fields(self):
            problem = field_type_error(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(problem)
        sources = [name for name in ("data", "task", "pairs") if getattr(self, name) is not None]
        if len(sources) > 1:
            raise ValueError(f"give one of data, task, pairs (--data/--task/--pairs); got {sources}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {sorted(TASKS)}")
        for name in ("steps", "batch_size", "grad_accum", "block_size", "eval_batches", "log_every", "keep",
                     "task_held_out"):  # fmt: skip
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be a positive integer{flag_of(name)}; got {value!r}")
        if not 0 <= self.seed < 2**63:  # numpy's and torch's seeds are unsigned 64-bit; 2**63 keeps it an int64
            raise ValueError(f"seed must be an integer in [0, 2**63) (--seed); got {self.seed}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} must divide evenly into grad_accum={self.grad_accum} "
                             "micro-batches (--batch-size, --grad-accum)")  # fmt: skip
        for name in ("warmup", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (--{name.replace('_', '-')}; 0 turns it off); got "
                                 f"{getattr(self, name)}")  # fmt: skip
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "label_smoothing", "val_fraction"):
            if not _is_finite_number(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number (--{name.replace('_', '-')}); got "
                                 f"{getattr(self, name)!r}")  # fmt: skip
        if not 0 < self.lr <= 1:  # AdamW moves every weight by about lr per step: above 1 nothing can be learned
            raise ValueError(f"lr must be in (0, 1] (--lr; AdamW moves each weight by about lr per step); got "
                             f"{self.lr:g}")  # fmt: skip
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr:g}] (--min-lr); got {self.min_lr:g}")
        for name, off in (("weight_decay", "0 = no decay"), ("grad_clip", "0 = off")):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (--{name.replace('_', '-')}; {off}); got {value:g}")
        if len(self.betas) != 2 or not all(_is_finite_number(b) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1); got {self.betas}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1) (--val-fraction); got {self.val_fraction}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1) (--label-smoothing); got {self.label_smoothing}")
        if self.task is not None:  # its lengths (the same check as when the task is built for training)
            SequenceTask(self.task, min_len=self.task_min_len, max_len=self.task_max_len)
        device = resolve_device(self.device)
        if self.model.get("attn_backend") == "triton" and device.type != "cuda" and not triton_interpreter():
            raise ValueError(f"attn_backend 'triton' (--attn-backend triton) runs on CUDA GPUs, and this run is on "
                             f"{device.type}; use --attn-backend auto (or sdpa, tiled)")  # fmt: skip
        out = Path(self.out)
        blocking = next(p for p in (out, *out.parents) if p.exists())  # the nearest existing path must be a folder
        if not blocking.is_dir():
            where = "" if blocking == out else f" lies under {blocking}, which"
            raise ValueError(f"--out {self.out}{where} is a file; give a directory")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16'; got {self.dtype!r}")
        if self.tokenizer not in ("byte", "char", "bpe"):
            raise ValueError(f"tokenizer must be 'byte', 'char' or 'bpe'; got {self.tokenizer!r}")
        if self.unknown not in ("unk", "skip", "error"):
            raise ValueError(f"unknown must be 'unk', 'skip' or 'error' (--unknown); got {self.unknown!r}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"stop_after must be in [1, steps={self.steps}]; got {self.stop_after}")
        self.check_model()

    def check_model(self) -> None:
        """``ValueError`` naming the flags, if ``model`` cannot make a :class:`TransformerConfig` of this run (built
        with a placeholder vocabulary: the tokenizer's size is known only after reading the data)."""
        bad = sorted(set(self.model) - {f.name for f in dataclasses.fields(TransformerConfig)})
        if bad or {"vocab_size", "pad_id"} & set(self.model):
            raise ValueError(f"model overrides {bad or ['vocab_size/pad_id']} are not settable TransformerConfig "
                             "fields (vocab_size and pad_id come from the tokenizer)")  # fmt: skip
        try:
            _model_config(self, vocab_size=256, pad_id=None)
        except TypeError as err:  # e.g. a dropout that is a string
            raise ValueError(f"model {self.model} does not make a TransformerConfig: {err}") from None
        except ValueError as err:
            flags = [flag for name, flag in MODEL_FLAGS.items() if re.search(rf"\b{name}\b", str(err))]
            raise ValueError(f"{err} ({', '.join(flags)})" if flags else str(err)) from None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "betas": list(self.betas)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _is_finite_number(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


@dataclass
class TrainResult:
    """What a ``train`` call did. Steps count completed optimizer steps (1 = after the first update)."""

    out: Path
    kind: str
    step: int
    losses: dict[int, float]  # training loss of every step run in this call
    val_losses: dict[int, float]
    val_accuracy: float | None  # seq2seq: exact match of greedy decodes on the held-out set, at the end
    tokens_per_s: float
    seconds: float
    checkpoint: Path | None
    interrupted: bool
    num_parameters: int

    @property
    def final_loss(self) -> float:
        """Mean training loss of the last (up to) 20 steps: one step's loss is too noisy to report."""
        last = sorted(self.losses)[-20:]
        return sum(self.losses[s] for s in last) / len(last) if last else float("nan")

    @property
    def val_loss(self) -> float:
        return self.val_losses[max(self.val_losses)] if self.val_losses else float("nan")


# --------------------------------------------------------------------------------------------------
# Pieces (importable: the benchmarks use the same optimizer and schedule)
# --------------------------------------------------------------------------------------------------
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with two groups: ``dim >= 2`` parameters decayed, the rest (biases, norms) not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = next(iter(params)).device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The torch RNG seed of one step on one rank (dropout): a pure function, so resume needs no RNG state."""
    return int(np.random.default_rng([seed, step, rank, 0xD50]).integers(2**62))


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """``None`` (float32) or the autocast dtype: ``auto`` is bfloat16 on CUDA GPUs that support it."""
    if cfg.dtype == "bfloat16":
        return torch.bfloat16
    if cfg.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def lm_loss_sum(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Sum over tokens of ``-log p(y_t | x_<=t)``: ``x, y (B, T)``."""
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")


def seq2seq_loss_sum(model: nn.Module, rows, pad_id: int, label_smoothing: float = 0.0) -> Tensor:
    """Sum over target tokens (padding ignored) of the (label-smoothed) cross-entropy."""
    src, src_mask, tgt_in, tgt_out, tgt_mask = rows
    logits = model(src, tgt_in, src_mask, tgt_mask)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=pad_id,
                           reduction="sum", label_smoothing=label_smoothing)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Data and model set-up
# --------------------------------------------------------------------------------------------------
@dataclass
class _Data:
    tokenizer: Tokenizer
    train: LMBatches | Seq2SeqBatches
    val: list
    held_out: list[tuple[list[int], list[int]]] | None = None  # seq2seq: (source ids, target ids)
    max_len: int = 0  # seq2seq: the longest source or target (+ BOS/EOS)


def _cached_tokenizer(cfg: TrainConfig, files: list[Path]) -> Tokenizer:
    """Build (or read from the cache) the char/BPE tokenizer of a corpus."""
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    name = f"tokenizer-{files_fingerprint(files)}-{cfg.tokenizer}-{cfg.vocab_size}-{cfg.unknown}.json"
    path = cache / name
    if path.is_file():
        return tokenizer_from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))
    tokenizer = build_tokenizer(cfg.tokenizer, iter_texts(files), vocab_size=cfg.vocab_size, unknown=cfg.unknown)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
    return tokenizer


def _prepare_data(cfg: TrainConfig, tokenizer: Tokenizer | None, files: list[Path]) -> _Data:
    """The tokenizer (``tokenizer``, or built from the data), batches and held-out set of a run; ``files``: the
    text files of an LM corpus (:func:`tformer.data.scan_corpus`)."""
    if cfg.kind == "lm":
        if tokenizer is None:
            tokenizer = build_tokenizer("byte") if cfg.tokenizer == "byte" else _cached_tokenizer(cfg, files)
        corpus = tokenize_corpus(files, tokenizer, val_fraction=cfg.val_fraction, cache_dir=cfg.cache_dir)
        train = LMBatches(corpus.train, cfg.block_size, cfg.batch_size, cfg.seed)
        val = LMBatches(corpus.val, cfg.block_size, cfg.batch_size, cfg.seed).evaluation(cfg.eval_batches)
        return _Data(tokenizer, train, val)
    if cfg.task is not None:
        task = SequenceTask(cfg.task, min_len=cfg.task_min_len, max_len=cfg.task_max_len)
        if tokenizer is None:
            tokenizer = CharTokenizer(task.alphabet, SEQ2SEQ_SPECIALS, unknown="error")
        sources = task.held_out(cfg.task_held_out, seed=1234)
        held = [(list(s), task.target(s)) for s in sources]
        withheld = {s for s in sources if task.can_withhold(s)}  # short lengths cannot be withheld (all of them)
        train = Seq2SeqBatches(cfg.batch_size, cfg.seed, task=task, exclude=withheld)
        max_len = max(task.max_source_len, task.max_target_len)
    else:
        pairs = load_pairs(cfg.pairs)
        train_idx, val_idx = split_pairs(len(pairs), cfg.val_fraction)
        if tokenizer is None:
            texts = (side for i in train_idx for side in pairs[i])
            tokenizer = build_tokenizer(cfg.tokenizer, texts, vocab_size=cfg.vocab_size,
                                        specials=SEQ2SEQ_SPECIALS, unknown=cfg.unknown)  # fmt: skip
        encoded = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]
        held = [encoded[i] for i in val_idx]
        train = Seq2SeqBatches(cfg.batch_size, cfg.seed, pairs=[encoded[i] for i in train_idx],
                               bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)  # fmt: skip
        max_len = max(max(len(s), len(t) + 2) for s, t in encoded)
    if (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) != (1, 2, 0):
        raise ValueError(f"a seq2seq tokenizer needs <pad>, <bos>, <eos> as ids 0, 1, 2; got {tokenizer}")
    val = evaluation_batches(held, cfg.batch_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    return _Data(tokenizer, train, val, held, max_len)


def model_config(cfg: TrainConfig, tokenizer: Tokenizer, max_len: int = 0) -> TransformerConfig:
    """The kind's default model, ``cfg.model`` overrides, vocabulary and padding from the tokenizer."""
    return _model_config(cfg, tokenizer.vocab_size, tokenizer.pad_id, max_len)


def _model_config(cfg: TrainConfig, vocab_size: int, pad_id: int | None, max_len: int = 0) -> TransformerConfig:
    base = dict(LM_MODEL if cfg.kind == "lm" else SEQ2SEQ_MODEL)
    base["max_seq_len"] = cfg.block_size if cfg.kind == "lm" else max(64, max_len)
    merged = {**base, **cfg.model, "vocab_size": vocab_size, "pad_id": pad_id}
    config = TransformerConfig(**merged)
    needed = cfg.block_size if cfg.kind == "lm" else max_len
    if config.position == "learned" and config.max_seq_len < needed:
        raise ValueError(f"model max_seq_len={config.max_seq_len} is shorter than the {needed} positions the data "
                         "needs (block_size or the longest example); raise max_seq_len")  # fmt: skip
    return config


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------
def _device(cfg: TrainConfig, world: World) -> torch.device:
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None:  # under torchrun each process takes its own GPU
        return torch.device("cuda", world.local_rank)
    return device


def damaged_checkpoint_error(out: str | os.PathLike, err: CheckpointError) -> CheckpointError:
    """The error for a latest checkpoint of run ``out`` that fails to load with ``err``: it names that checkpoint
    and the newest earlier one that verifies (nothing is deleted)."""
    found = list_checkpoints(Path(out) / CHECKPOINTS_DIR)
    if not found:
        return err
    good = None
    for candidate in reversed(found[:-1]):
        try:
            read_manifest(candidate)  # verifies every file's size and SHA-256
        except CheckpointError:
            continue
        good = candidate
        break
    hint = (f"delete it to resume from {good.name}" if good is not None else
            "no earlier checkpoint verifies; train without --resume into another --out")  # fmt: skip
    return CheckpointError(f"checkpoint {found[-1].name} is damaged ({err}); {hint}")


def _check_resumable(cfg: TrainConfig, ckpt: Checkpoint) -> None:
    if ckpt.kind != cfg.kind:
        raise ValueError(f"the checkpoint in {cfg.out} is a {ckpt.kind!r} model but this run trains a {cfg.kind!r} "
                         "one; resume with the same --data/--task/--pairs or train into another --out")  # fmt: skip
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
        raise ValueError(f"the checkpoint is already at step {ckpt.step} >= steps={cfg.steps}; raise --steps to "
                         "train further")  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: list, kind: str, pad_id: int | None, world: World,
                  amp: torch.dtype | None, device: torch.device, chunk: int) -> float:  # fmt: skip
    """Mean per-token cross-entropy over ``batches`` (no label smoothing), ``chunk`` rows at a time.

    Each rank takes its share of every batch's rows; the sums are all-reduced, so the result does not depend on
    the number of processes.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, tokens]
    for batch in batches:
        lo, hi = len(batch) * world.rank // world.size, len(batch) * (world.rank + 1) // world.size
        for first in range(lo, hi, chunk):
            rows = tuple(t.to(device) for t in batch.rows(first, min(first + chunk, hi)))
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                s = lm_loss_sum(model, *rows) if kind == "lm" else seq2seq_loss_sum(model, rows, pad_id)
            count = rows[1].numel() if kind == "lm" else (rows[3] != pad_id).sum()
            total += torch.stack([s.double(), torch.as_tensor(count, dtype=torch.float64, device=device)])
    if world.size > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


@torch.no_grad()
def exact_match(model: nn.Module, held_out: list[tuple[list[int], list[int]]], tokenizer: Tokenizer,
                device: torch.device, batch_size: int = 250) -> float:  # fmt: skip
    """Fraction of held-out sources whose greedy decode equals the target exactly."""
    model = unwrap(model)
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(held_out), batch_size):
        chunk = held_out[i : i + batch_size]
        batch = evaluation_batches(chunk, len(chunk), tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)[0]
        src, src_mask, *_ = (t.to(device) for t in batch.rows(0, len(chunk)))
        longest = max(len(t) for _, t in chunk) + 1
        predictions = greedy_seq2seq(model, src, src_mask, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                     max_new_tokens=longest)  # fmt: skip
        correct += sum(p == list(t) for p, (_, t) in zip(predictions, chunk, strict=True))
    model.train(was_training)
    return correct / len(held_out)


def train(cfg: TrainConfig) -> TrainResult:
    """Train (or resume) the model ``cfg`` describes; see the module docstring for the exact procedure.

    Raises ``ValueError`` / ``FileNotFoundError`` / ``FileExistsError`` / ``CheckpointError`` for settings, data
    or run directories that cannot work (before training), and :class:`TrainingError` when the loss diverges or
    another run is writing to ``cfg.out``.
    """
    cfg.validate()  # everything that can be checked before OUT is created for the lock
    scan = scan_corpus(cfg.data) if cfg.kind == "lm" else None  # the corpus's text files (a folder with none fails)
    if cfg.pairs is not None:
        check_pairs_file(cfg.pairs)
    world = init_world(cfg.device)
    try:
        if cfg.batch_size % (world.size * cfg.grad_accum):
            raise ValueError(f"batch_size={cfg.batch_size} must divide evenly into {world.size} processes x "
                             f"grad_accum={cfg.grad_accum} micro-batches (--batch-size, --grad-accum)")  # fmt: skip
        device = _device(cfg, world)
        created = _missing_folders(Path(cfg.out))  # what the lock is about to create, removed if the run fails early
        with contextlib.ExitStack() as stack:
            locked: TrainingError | None = None
            if world.main:  # rank 0 writes OUT, so rank 0 holds the lock; every rank learns whether it got it
                try:
                    stack.enter_context(run_lock(cfg.out))
                except TrainingError as err:
                    locked = err
            if not all_ranks_agree(world, device, locked is None):
                raise locked or TrainingError(f"rank 0 could not lock {cfg.out}; another run is writing there")
            try:
                return _train(cfg, world, device, scan)
            except BaseException:  # also Ctrl-C during tokenization: the lock is still held here
                if world.main and created:
                    _remove_unused_run_folder(created)
                raise
    finally:
        if world.owns_group:
            dist.destroy_process_group()


def _missing_folders(out: Path) -> list[Path]:
    """``out`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for folder in (out.absolute(), *out.absolute().parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _remove_unused_run_folder(created: list[Path]) -> None:
    """After a run failed: remove the folders it created (``created``, deepest first: OUT and the parents it
    made), but only while OUT holds nothing but the run's own ``.lock`` and an empty ``metrics.jsonl`` (once
    training has logged a step, the metrics and the loss plot tell what happened, and they are kept)."""
    out = created[0]
    entries = list(out.iterdir()) if out.is_dir() else []
    if any(p.name not in (LOCK_FILE, "metrics.jsonl") or not p.is_file() for p in entries):
        return
    if any(p.name == "metrics.jsonl" and p.stat().st_size > 0 for p in entries):
        return
    for p in entries:
        p.unlink()
    for folder in created:
        try:
            folder.rmdir()  # only an empty folder: anything another process put there meanwhile stays
        except OSError:
            return


def _train(cfg: TrainConfig, world: World, device: torch.device, scan: CorpusScan | None) -> TrainResult:
    out = Path(cfg.out)
    micro_rows = cfg.batch_size // (world.size * cfg.grad_accum)

    ckpt = None
    if cfg.resume:
        if find_latest(out) is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'}; train without --resume first")
        try:  # on this run's attention backend: all are exact, so a run may continue on another one
            ckpt = load_checkpoint(out, with_state=True, attn_backend=cfg.model.get("attn_backend", "auto"))
        except CheckpointError as err:
            raise damaged_checkpoint_error(out, err) from None
        _check_resumable(cfg, ckpt)
    elif find_latest(out) is not None:
        raise FileExistsError(f"{out} already holds checkpoints (latest {find_latest(out).name}); pass --resume to "
                              "continue that run, or choose another --out")  # fmt: skip

    end = cfg.stop_after if cfg.stop_after is not None else cfg.steps
    if ckpt is not None and end <= ckpt.step:
        raise ValueError(f"stop_after={end} is not after the checkpoint's step {ckpt.step}; nothing to train")
    if world.main and scan is not None and scan.skipped():
        print(f"data: skipped {scan.skipped()} under {cfg.data}", file=sys.stderr)
    for turn in (True, False):  # rank 0 builds the tokenizer and token caches first; the others then read them
        if world.main == turn:
            data = _prepare_data(cfg, ckpt.tokenizer if ckpt else None, scan.files if scan else [])
        world.barrier()
    tokenizer = data.tokenizer
    config = model_config(cfg, tokenizer, data.max_len)

    if ckpt is not None:
        if ckpt.config != config:
            raise CheckpointError(f"{ckpt.path}: saved model config {ckpt.config} differs from {config}")
        model, start = ckpt.model, ckpt.step
    else:
        torch.manual_seed(cfg.seed)
        model, start = model_class(cfg.kind)(config), 0
    model.to(device).train()
    optimizer = make_optimizer(model, cfg)
    tokens_seen = 0
    loss_window: list[float] = []  # losses of the steps since the last log boundary (a multiple of log_every)
    if ckpt is not None:
        state = ckpt.trainer_state
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        tokens_seen = int(state["tokens_seen"])
        saved = [float(v) for v in state.get("loss_window", [])]  # absent in checkpoints of older versions
        loss_window = saved[max(0, len(saved) - start % cfg.log_every) :] if start % cfg.log_every else []
        if state["data"]["next_index"] != start:
            raise CheckpointError(f"{ckpt.path}: data position {state['data']['next_index']} != step {start}")
    n_params = sum(p.numel() for p in model.parameters())
    net: nn.Module = model
    if world.size > 1:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        net = torch.compile(net)
    amp = autocast_dtype(cfg, device)

    metrics_path = out / "metrics.jsonl"
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        # Drop the records of steps after the checkpoint (they are redone), and the loss record of a stop between
        # log boundaries: the window it averaged goes on, so the next record covers the steps it would have.
        mid_window = start % cfg.log_every != 0
        kept = [r for r in read_metrics(metrics_path) if r.get("step", 0) < start
                or (r.get("step") == start and not (mid_window and "loss" in r))] if ckpt else []  # fmt: skip
        _rewrite_jsonl(metrics_path, kept)
    metrics = open(metrics_path, "a", encoding="utf-8") if world.main else None  # noqa: SIM115

    def save(step: int) -> Path | None:
        if not world.main:
            return None
        trainer_state = {"optimizer": optimizer.state_dict(), "rng": rng_state(), "tokens_seen": tokens_seen,
                         "data": {"next_index": step, "seed": cfg.seed}, "loss_window": list(loss_window)}  # fmt: skip
        return save_checkpoint(out, model=model, tokenizer=tokenizer, kind=cfg.kind, step=step,
                               train_config=cfg.to_dict(), trainer_state=trainer_state, keep=cfg.keep)  # fmt: skip

    def record(entry: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.write(json.dumps(entry) + "\n")
            metrics.flush()

    def check_finite(what: str, value: float, step: int) -> None:
        if not math.isfinite(value):
            latest = find_latest(out)
            kept = f"checkpoints up to {latest.name} are intact" if latest else "no checkpoint was written"
            clip = f"lower --grad-clip (now {cfg.grad_clip:g})" if cfg.grad_clip > 0 else "turn on --grad-clip"
            raise TrainingError(f"training diverged: {what} is {value} at step {step}; lower --lr (now {cfg.lr:g}), "
                                f"raise --warmup (now {cfg.warmup}) or {clip}; {kept}")  # fmt: skip

    losses: dict[int, float] = {}
    val_losses: dict[int, float] = {}
    pending: list[Tensor] = []  # per-step loss sums not yet read back (avoids a device sync every step)
    pad_id = tokenizer.pad_id
    bar = _progress_bar(cfg, world, start, n_params)
    t0 = time.perf_counter()
    window_start, window_tokens = t0, 0
    interrupted, step = False, start

    accuracy = None
    try:
        with StopFlag() as stop:
            for step in range(start, end):
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                torch.manual_seed(step_seed(cfg.seed, step, world.rank))
                batch = data.train.get(step)
                pending.append(_accumulate_gradients(net, batch, cfg, world, micro_rows, device, amp, pad_id))
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done = step + 1
                tokens_seen += batch.num_tokens
                window_tokens += batch.num_tokens

                if world.size > 1:  # every rank must agree to stop at the same step
                    flag = torch.tensor([float(stop.requested)], device=device)
                    dist.all_reduce(flag)
                    stop.requested = bool(flag.item())
                last = done == end or stop.requested
                boundary = done % cfg.log_every == 0
                saving = (cfg.save_every and done % cfg.save_every == 0) or last
                if boundary or last or saving:  # the one host sync per log interval (and before a checkpoint)
                    values = torch.stack(pending)
                    if world.size > 1:
                        dist.all_reduce(values)  # each rank holds its share of the global mean
                    first_step = done - len(pending) + 1
                    pending.clear()
                    for i, value in enumerate(values.tolist()):
                        check_finite("the training loss", value, first_step + i)
                        losses[first_step + i] = value
                        loss_window.append(value)
                if boundary or last:
                    now = time.perf_counter()
                    rate = window_tokens / max(now - window_start, 1e-9)
                    window_start, window_tokens = now, 0
                    mean = sum(loss_window) / len(loss_window)
                    record({"step": done, "loss": mean, "lr": lr, "tokens_per_s": rate, "tokens": tokens_seen,
                            "elapsed": now - t0})  # fmt: skip
                    if boundary:
                        loss_window.clear()
                    if bar is not None:
                        bar.set_postfix(loss=f"{mean:.4f}", tok_s=f"{rate:,.0f}", lr=f"{lr:.2e}", refresh=False)
                        bar.update(done - bar.n)
                paused = time.perf_counter()  # evaluation and saving do not count against tokens/s
                if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                    val_losses[done] = evaluate_loss(net, data.val, cfg.kind, pad_id, world, amp, device, micro_rows)
                    check_finite("the validation loss", val_losses[done], done)
                    record({"step": done, "val_loss": val_losses[done]})
                    if bar is not None:
                        bar.write(f"step {done}: validation loss {val_losses[done]:.4f}")
                if saving:  # the losses so far are finite; the update of this very step must be too (one sync)
                    finite = torch.stack([p.isfinite().all() for p in model.parameters()]).all()
                    check_finite("a weight", 0.0 if bool(finite) else math.nan, done)
                    save(done)
                window_start += time.perf_counter() - paused
                if stop.requested:
                    interrupted = True
                    break
        seconds = time.perf_counter() - t0
        if cfg.kind == "seq2seq" and world.main and step + 1 == cfg.steps and not interrupted:
            accuracy = exact_match(model, data.held_out, tokenizer, device)
            record({"step": cfg.steps, "val_accuracy": accuracy})
    finally:  # also on an exception or a second Ctrl-C: close the log and draw what there is
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
            plot_loss(read_metrics(metrics_path), out / "loss.png", title=f"{cfg.kind} training ({n_params:,} params)")
    world.barrier()
    run_tokens = tokens_seen - (int(ckpt.trainer_state["tokens_seen"]) if ckpt else 0)
    return TrainResult(
        out=out,
        kind=cfg.kind,
        step=max(losses) if losses else start,
        losses=losses,
        val_losses=val_losses,
        val_accuracy=accuracy,
        tokens_per_s=run_tokens / max(seconds, 1e-9),
        seconds=seconds,
        checkpoint=find_latest(out),
        interrupted=interrupted,
        num_parameters=n_params,
    )


def _accumulate_gradients(net: nn.Module, batch, cfg: TrainConfig, world: World, micro_rows: int,
                          device: torch.device, amp: torch.dtype | None, pad_id: int | None) -> Tensor:  # fmt: skip
    """Forward and backward this rank's micro-batches of one global batch; returns its share of the mean loss.

    Each micro-batch loss is a *sum* over its tokens scaled by ``world_size / global tokens``; DDP then averages
    the gradients over ranks, so the accumulated gradient is that of the mean loss over the global batch. DDP
    all-reduces only after the last micro-batch (``no_sync`` before).
    """
    scale = world.size / batch.num_tokens
    smoothing = cfg.label_smoothing if cfg.kind == "seq2seq" else 0.0
    total = torch.zeros((), device=device)
    for micro in range(cfg.grad_accum):
        first = (micro * world.size + world.rank) * micro_rows
        rows = tuple(t.to(device, non_blocking=True) for t in batch.rows(first, first + micro_rows))
        sync = world.size == 1 or micro == cfg.grad_accum - 1
        with (
            contextlib.nullcontext() if sync else net.no_sync(),
            torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None),
        ):
            s = lm_loss_sum(net, *rows) if cfg.kind == "lm" else seq2seq_loss_sum(net, rows, pad_id, smoothing)
            (s * scale).backward()
        total += s.detach()
    return total / batch.num_tokens


def _progress_bar(cfg: TrainConfig, world: World, start: int, n_params: int):
    if not (cfg.progress and world.main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True,
                desc=f"{cfg.kind} {n_params / 1e6:.2f}M params")  # fmt: skip


def _rewrite_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)
