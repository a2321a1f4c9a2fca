"""The settings of a training run: :class:`TrainConfig` (typed, validated before anything is written), the
default models of each kind, and :class:`TrainResult`, what :func:`tformer.training.train` returns.

Every setting maps to one ``tformer train`` flag, and every error names the flag that fixes it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tformer.config import TransformerConfig
from tformer.training.runtime import resolve_device, triton_interpreter
from tformer.training.tasks import TASKS, SequenceTask
from tformer.training.tokenizers import Tokenizer

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
    task: str | None = None  # seq2seq: a built-in task of tformer.training.tasks
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
