"""The settings of a training run: :class:`TrainConfig`, the one source of every setting (typed, validated before
anything is written; its fields also give ``tformer train`` its flags, help, choices and defaults), the default
models of each kind, and :class:`TrainResult`, what :func:`tformer.training.train` returns.

Every error names the setting (the field, in Python) and its flag (on the command line).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tformer.config import ConfigError, TransformerConfig
from tformer.tokenizers import Tokenizer
from tformer.training.settings import (
    field_types,
    finite_at_least,
    finite_in,
    flag_of,
    info,
    non_negative,
    positive,
    rule_problem,
    setting,
    type_problem,
    where,
)
from tformer.training.tasks import TASKS, SequenceTask

if TYPE_CHECKING:
    from torch import nn

Kind = Literal["lm", "seq2seq"]
Dtype = Literal["auto", "float32", "bfloat16"]

_MODEL = dict(d_model=128, num_heads=4, d_ff=512, dropout=0.0, norm_first=True, tie_embeddings=True)
LM_MODEL = {**_MODEL, "num_layers": 4, "position": "learned", "activation": "gelu"}
SEQ2SEQ_MODEL = {**_MODEL, "num_layers": 2, "position": "sinusoidal", "activation": "relu"}


@dataclass(frozen=True)
class ModelFlag:
    """The ``tformer train`` flag of a :class:`TransformerConfig` field; ``words`` map what is typed to the value
    (``--norm pre`` sets ``norm_first=True``)."""

    flag: str
    words: dict[str, Any] | None = None


# The model settings `tformer train` has flags for: TransformerConfig field -> its flag (help and type come from the
# field; vocab_size, pad_id and max_seq_len come from the tokenizer and the data)
MODEL_FLAGS: dict[str, ModelFlag] = {
    "d_model": ModelFlag("--d-model"),
    "num_layers": ModelFlag("--layers"),
    "num_heads": ModelFlag("--heads"),
    "num_kv_heads": ModelFlag("--kv-heads"),
    "d_ff": ModelFlag("--d-ff"),
    "dropout": ModelFlag("--dropout"),
    "position": ModelFlag("--position"),
    "activation": ModelFlag("--activation"),
    "norm_first": ModelFlag("--norm", {"pre": True, "post": False}),
    "attn_backend": ModelFlag("--attn-backend"),
}

_TASK_TOKENIZER = "their tokenizer is the task's alphabet"
_WHOLE_EXAMPLES = "seq2seq models read whole examples, not --block-size windows"
_HELD_OUT = "seq2seq runs validate on all held-out examples"
_TASK_ONLY = "it shapes the generated examples of --task runs"


def _seed_rule(value: int):
    return None if 0 <= value < 2**63 else "an integer in [0, 2**63)"  # numpy's and torch's seeds are 64-bit


def _betas_rule(value: tuple[float, float]):
    return None if all(0 <= b < 1 for b in value) else "two numbers in [0, 1)"


@dataclass
class TrainConfig:
    """What to train, on what, and how. Exactly one of ``data`` / ``task`` / ``pairs`` (none: the stdlib LM).

    ``out=None`` trains in memory (no checkpoints, metrics or plot; the result holds the model). ``model``
    overrides fields of the default model of the kind (``LM_MODEL`` / ``SEQ2SEQ_MODEL``); ``vocab_size`` and
    ``pad_id`` always come from the tokenizer. ``batch_size`` is the global batch per optimizer step; it must split
    evenly into ``world_size * grad_accum`` micro-batches.
    """

    out: str | None = setting(
        None, "run directory: checkpoints/, metrics.jsonl, loss.png", group="run", expected="a path", required=True
    )
    data: str | None = setting(
        None,
        "LM corpus: a text file or a folder of text files (default: the Python stdlib)",
        group="source",
        expected="a path",
    )
    task: str | None = setting(
        None, "seq2seq: a built-in task", group="source", expected="a task name", choices=tuple(TASKS)
    )
    pairs: str | None = setting(None, "seq2seq: a file of source<TAB>target lines", group="source", expected="a path")
    resume: bool = setting(False, "continue the run in --out from its latest checkpoint", group="run")
    steps: int = setting(1000, "total optimizer steps", group="run", rule=positive)
    stop_after: int | None = setting(
        None, "end this run after this step (the schedule still spans --steps)", group="run"
    )
    tokenizer: Literal["byte", "char", "bpe"] = setting(
        "byte", "byte, char or bpe", group="tokenizer", sources=("data", "pairs"), why=_TASK_TOKENIZER
    )
    vocab_size: int = setting(
        1024,
        "BPE vocabulary size",
        group="tokenizer",
        rule=positive,
        sources=("data", "pairs"),
        tokenizers=("bpe",),
        why=_TASK_TOKENIZER,
    )
    unknown: Literal["unk", "skip", "error"] = setting(
        "unk",
        "char: what becomes of characters the corpus lacks",
        group="tokenizer",
        sources=("data", "pairs"),
        tokenizers=("char",),
        why=_TASK_TOKENIZER,
    )
    model: dict[str, Any] = setting(
        {},
        "TransformerConfig fields overriding the kind's default model",
        group="model",
        expected="a dict of TransformerConfig fields",
        flag="",
    )
    init_from: str | None = setting(
        None,
        "fine-tune: start from this model's architecture, weights and tokenizer (a tformer run or checkpoint, a "
        "Hugging Face folder, a GGUF file, or smollm2: the shipped SmolLM2-135M-Instruct)",
        group="model",
        expected="a path",
        sources=("data",),
        why="a seq2seq run builds its own model and tokenizer",
    )
    block_size: int = setting(
        128, "LM context length", group="model", rule=positive, sources=("data",), why=_WHOLE_EXAMPLES
    )
    batch_size: int = setting(32, "global sequences per step", group="optimization", rule=positive)
    grad_accum: int = setting(1, "micro-batches per step", group="optimization", rule=positive)
    lr: float = setting(
        1e-3,
        "peak learning rate",
        group="optimization",
        rule=finite_in(0, 1, low_open=True, note="AdamW moves each weight by about lr per step"),
    )
    min_lr: float = setting(
        1e-4, "final learning rate of the cosine", group="optimization", rule=finite_at_least(0, "the cosine's floor")
    )
    warmup: int = setting(100, "linear warm-up steps", group="optimization", rule=non_negative("0 turns it off"))
    weight_decay: float = setting(
        0.1, "AdamW decay of the weight matrices", group="optimization", rule=finite_at_least(0, "0 = no decay")
    )
    betas: tuple[float, float] = setting(
        (0.9, 0.99), "AdamW's moment decays", group="optimization", rule=_betas_rule, expected="two numbers"
    )
    grad_clip: float = setting(
        1.0, "max gradient norm (0: no clipping)", group="optimization", rule=finite_at_least(0, "0 = off")
    )
    label_smoothing: float = setting(
        0.1,
        "seq2seq: the share of each target's probability spread over the vocabulary",
        group="optimization",
        rule=finite_in(0, 1, high_open=True),
        sources=("task", "pairs"),
        why="only seq2seq (--task/--pairs) runs smooth their labels",
    )
    seed: int = setting(0, "seed of the weights, the batches and dropout", group="optimization", rule=_seed_rule)
    dtype: Dtype = setting("auto", "autocast: auto = bfloat16 on CUDA, float32 on CPU", group="optimization")
    compile: bool = setting(False, "torch.compile the model", group="optimization")
    device: str = setting("auto", "auto (CUDA if there is a GPU), cpu, cuda, cuda:1 ...", group="optimization")
    val_fraction: float = setting(
        0.1,
        "held-out share of the data",
        group="data",
        rule=finite_in(0, 1, low_open=True, high_open=True),
        sources=("data", "pairs"),
        why="tasks hold out generated examples, not a share of a corpus",
    )
    task_min_len: int = setting(
        1, "task: shortest source (add: digits)", group="data", rule=positive, sources=("task",), why=_TASK_ONLY
    )
    task_max_len: int = setting(
        16,
        "task: longest source (add: digits)",
        group="data",
        rule=positive,
        sources=("task",),
        why="it sets the length of generated --task examples",
    )
    task_held_out: int = setting(
        500,
        "task: held-out sources (never trained on, where a length has enough)",
        group="data",
        rule=positive,
        sources=("task",),
        why=_TASK_ONLY,
    )
    cache_dir: str | None = setting(
        None,
        "token cache (default $TFORMER_CACHE or ~/.cache/tformer)",
        group="data",
        expected="a path",
        sources=("data", "pairs"),
        why="tasks generate their examples; nothing is tokenized into a cache",
    )
    eval_every: int = setting(
        250,
        "steps between validation losses (0: only at the end)",
        group="bookkeeping",
        rule=non_negative("0 = only at the end"),
    )
    eval_batches: int = setting(
        20, "LM validation batches", group="bookkeeping", rule=positive, sources=("data",), why=_HELD_OUT
    )
    save_every: int = setting(
        500, "steps between checkpoints (0: only at the end)", group="bookkeeping", rule=non_negative("0 turns it off")
    )
    keep: int = setting(2, "newest checkpoints kept, older ones deleted", group="bookkeeping", rule=positive)
    log_every: int = setting(10, "steps between progress/metrics updates", group="bookkeeping", rule=positive)
    progress: bool = setting(True, "a progress bar and validation lines (else see metrics.jsonl)", group="bookkeeping")

    def __post_init__(self) -> None:
        for name in ("out", "data", "pairs", "cache_dir", "init_from"):  # paths as strings (JSON in checkpoints)
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        for name in ("data", "pairs", "cache_dir", "init_from"):  # absolute: --resume works from any directory
            value = getattr(self, name)  # '' stays, for validate to refuse; a shipped model's name stays a name
            if isinstance(value, str) and value and not (name == "init_from" and _shipped_name(value)):
                setattr(self, name, os.path.abspath(os.path.expanduser(value)))
        if isinstance(self.betas, list):  # JSON has no tuples
            self.betas = tuple(self.betas)

    @property
    def kind(self) -> Kind:
        return "lm" if self.task is None and self.pairs is None else "seq2seq"

    @property
    def source(self) -> Literal["data", "task", "pairs"]:
        """The kind of data the run trains on (``data`` also for the default stdlib corpus)."""
        return "task" if self.task is not None else "pairs" if self.pairs is not None else "data"

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the bad setting, its flag and what would be valid: every setting, the
        model's included, is checked here, before any run directory is created or any data is read."""
        types = field_types(type(self))
        for f in dataclasses.fields(self):
            problem = type_problem(f, types[f.name], getattr(self, f.name))
            if problem:
                raise ConfigError(problem, f.name)
        for f in dataclasses.fields(self):
            problem = rule_problem(f, getattr(self, f.name))
            if problem:
                raise ConfigError(problem, f.name)
        self._check_combinations()
        changed = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != _default(f)]
        ignored = settings_that_do_not_apply(self, changed)
        if ignored:
            name, why = next(iter(ignored.items()))
            raise ConfigError(
                f"{name}{where(self._field(name))} does not apply to {runs_of(self)} ({why}); leave it at its default",
                *ignored,
            )
        self.check_model()

    def _field(self, name: str) -> dataclasses.Field:
        return next(f for f in dataclasses.fields(self) if f.name == name)

    def _check_paths(self) -> None:
        """The paths but ``out``'s folder: none empty (``Path("")`` is the current folder, never what an empty value
        meant), the cache a folder, the model to fine-tune (:func:`tformer.training.finetune.check_init_from`)."""
        if self.cache_dir is not None and Path(self.cache_dir).exists() and not Path(self.cache_dir).is_dir():
            raise ConfigError(f"cache_dir {self.cache_dir} is a file (--cache-dir); give a folder", "cache_dir")
        if self.out == "":
            raise ConfigError("out must be a directory (--out); got '' (use --out . for the current directory)", "out")
        paths = {"data": "a text file or a folder", "pairs": "a file of source<TAB>target lines"}
        for name, what in {**paths, "cache_dir": "a folder", "init_from": "a model"}.items():
            if getattr(self, name) == "":
                flag = flag_of(self._field(name))
                hint = "" if name in ("pairs", "init_from") else f" (use {flag} . for the current folder)"
                raise ConfigError(f"{name} must be {what} ({flag}); got ''{hint}", name)
        if self.init_from is not None:
            from tformer.training.finetune import check_init_from  # it imports this module

            check_init_from(self)

    def _check_combinations(self) -> None:
        """The checks that involve more than one setting, or the machine."""
        sources = [name for name in ("data", "task", "pairs") if getattr(self, name) is not None]
        if len(sources) > 1:
            raise ConfigError(f"give one of data, task, pairs (--data/--task/--pairs); got {sources}", *sources)
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"batch_size={self.batch_size} must divide evenly into grad_accum={self.grad_accum} "
                "micro-batches (--batch-size, --grad-accum)",
                "batch_size",
                "grad_accum",
            )
        if self.min_lr > self.lr:
            raise ConfigError(
                f"min_lr must be in [0, lr={self.lr:g}]{where(self._field('min_lr'))}; got {self.min_lr:g} (e.g. "
                f"--min-lr {self.lr / 10:g}, a tenth of --lr)",
                "min_lr",
                "lr",
            )
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ConfigError(
                f"stop_after must be in [1, steps={self.steps}]{where(self._field('stop_after'))}; got "
                f"{self.stop_after}",
                "stop_after",
                "steps",
            )
        if self.task is not None:  # its lengths (the same check as when the task is built for training)
            SequenceTask(self.task, min_len=self.task_min_len, max_len=self.task_max_len)
        from tformer.runtime import resolve_device  # imported here: the command line builds its flags without torch
        from tformer.training.runtime import triton_interpreter

        try:
            device = resolve_device(self.device)
        except ValueError as err:
            raise ConfigError(str(err), "device") from None
        if self.model.get("attn_backend") == "triton" and device.type != "cuda" and not triton_interpreter():
            raise ConfigError(
                f"attn_backend 'triton' (--attn-backend triton) runs on CUDA GPUs, and this run is on "
                f"{device.type}; use --attn-backend auto (or sdpa, tiled)",
                "attn_backend",
            )
        if self.model.get("dropout", 0) and self.model.get("attn_backend") in ("tiled", "triton"):
            backend = self.model["attn_backend"]
            raise ConfigError(
                f"attn_backend {backend!r} does not implement attention dropout, and this run's model has "
                f"dropout={self.model['dropout']}; use --attn-backend auto or sdpa, or --dropout 0 "
                "(--dropout, --attn-backend)",
                "dropout",
                "attn_backend",
            )
        self._check_paths()
        if self.out is None:
            if self.resume:
                raise ConfigError("resume needs the run directory to resume (--out)", "resume", "out")
            return
        out = Path(self.out)
        blocking = next(p for p in (out, *out.parents) if p.exists())  # the nearest existing path must be a folder
        if not blocking.is_dir():
            where_ = "" if blocking == out else f" lies under {blocking}, which"
            raise ConfigError(f"--out {self.out}{where_} is a file; give a directory", "out")

    def check_model(self) -> None:
        """:class:`ConfigError` naming the flags, if ``model`` cannot make a :class:`TransformerConfig` of this run
        (built with a placeholder vocabulary: the tokenizer's size is known only after reading the data)."""
        bad = sorted(set(self.model) - {f.name for f in dataclasses.fields(TransformerConfig)})
        if bad or {"vocab_size", "pad_id"} & set(self.model):
            raise ConfigError(
                f"model overrides {bad or ['vocab_size/pad_id']} are not settable TransformerConfig "
                "fields (vocab_size and pad_id come from the tokenizer)",
                "model",
            )
        try:
            build_model_config(self, vocab_size=256, pad_id=None)
        except TypeError as err:  # e.g. a dropout that is a string
            raise ConfigError(f"model {self.model} does not make a TransformerConfig: {err}", "model") from None
        except ConfigError as err:
            flags = [spec.flag for name, spec in MODEL_FLAGS.items() if name in err.fields]
            raise ConfigError(f"{err} ({', '.join(flags)})" if flags else str(err), *err.fields) from None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "betas": list(self.betas)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def runs_of(cfg: TrainConfig) -> str:
    return "language-model (--data) runs" if cfg.source == "data" else f"--{cfg.source} runs"


def settings_that_do_not_apply(cfg: TrainConfig, names) -> dict[str, str]:
    """Setting -> why it does nothing in this kind of run, for the settings among ``names`` that would be ignored
    (each field says which sources and tokenizers it applies to, and why)."""
    reasons: dict[str, str] = {}
    for f in dataclasses.fields(TrainConfig):
        meta = info(f)
        if f.name not in names:
            continue
        if meta.sources and cfg.source not in meta.sources:
            reasons[f.name] = meta.why
        elif meta.tokenizers and cfg.tokenizer not in meta.tokenizers:
            what = "sizes a BPE vocabulary" if f.name == "vocab_size" else "is the char tokenizer's policy"
            reasons[f.name] = f"it {what} and this run's tokenizer is {cfg.tokenizer}"
    return reasons


def check_saved_value(name: str, value: Any) -> str | None:
    """What is wrong with the type of a saved ``train_config`` value (``None``: nothing, or not a setting)."""
    f = next((f for f in dataclasses.fields(TrainConfig) if f.name == name), None)
    return None if f is None else type_problem(f, field_types(TrainConfig)[name], value)


# Settings that define the model and its data: a resumed run must keep them.
STRUCTURAL = (
    "init_from", "data", "task", "pairs", "tokenizer", "vocab_size", "unknown",
    "val_fraction", "model", "block_size", "task_min_len", "task_max_len", "task_held_out", "batch_size",
    "seed",
)  # fmt: skip


@dataclass
class TrainResult:
    """What a ``train`` call did. Steps count completed optimizer steps (1 = after the first update)."""

    out: Path | None
    kind: str
    step: int
    losses: dict[int, float]  # training loss of every step run in this call
    val_losses: dict[int, float]
    val_accuracy: float | None  # seq2seq: exact match of greedy decodes on the held-out set, at the end
    tokens_per_s: float  # of the training steps: evaluations and saves are not counted (as in metrics.jsonl)
    seconds: float
    checkpoint: Path | None
    interrupted: bool
    num_parameters: int
    label_smoothing: float = 0.0  # in the training losses (seq2seq); the validation losses have none
    trained_held_out: int = 0  # held-out examples training may draw too (a task's lengths too short to withhold)
    model: nn.Module | None = dataclasses.field(default=None, repr=False)  # the trained model, in eval mode
    tokenizer: Tokenizer | None = dataclasses.field(default=None, repr=False)

    @property
    def final_loss(self) -> float:
        """Mean training loss of the last (up to) 20 steps: one step's loss is too noisy to report."""
        last = sorted(self.losses)[-20:]
        return sum(self.losses[s] for s in last) / len(last) if last else float("nan")

    @property
    def val_loss(self) -> float:
        return self.val_losses[max(self.val_losses)] if self.val_losses else float("nan")


def _shipped_name(value: str) -> bool:
    """``value`` names a model tformer ships (``smollm2``) and is not a path that exists (which wins)."""
    if Path(value).exists():
        return False
    from tformer.interop.shipped import SHIPPED  # imported here: the command line builds its flags without torch

    return value in SHIPPED


def model_config(cfg: TrainConfig, tokenizer: Tokenizer, max_len: int = 0) -> TransformerConfig:
    """The kind's default model, ``cfg.model`` overrides, vocabulary and padding from the tokenizer."""
    return build_model_config(cfg, tokenizer.vocab_size, tokenizer.pad_id, max_len)


def build_model_config(cfg: TrainConfig, vocab_size: int, pad_id: int | None, max_len: int = 0) -> TransformerConfig:
    base = dict(LM_MODEL if cfg.kind == "lm" else SEQ2SEQ_MODEL)
    base["max_seq_len"] = cfg.block_size if cfg.kind == "lm" else max(64, max_len)
    config = TransformerConfig(**{**base, **cfg.model, "vocab_size": vocab_size, "pad_id": pad_id})
    needed = cfg.block_size if cfg.kind == "lm" else max_len
    if config.position == "learned" and config.max_seq_len < needed:
        raise ConfigError(
            f"model max_seq_len={config.max_seq_len} is shorter than the {needed} positions the data "
            "needs (block_size or the longest example); raise max_seq_len",
            "max_seq_len",
        )
    return config


__all__ = [
    "LM_MODEL",
    "MODEL_FLAGS",
    "SEQ2SEQ_MODEL",
    "STRUCTURAL",
    "ModelFlag",
    "TrainConfig",
    "TrainResult",
    "build_model_config",
    "check_saved_value",
    "model_config",
]
