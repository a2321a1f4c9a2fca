"""Fine-tuning (``init_from``, ``tformer train --init-from PATH``): a language-model run that starts from another
model's architecture, weights and tokenizer instead of a fresh model, e.g. GPT-2 or SmolLM2 trained further on
your own text.

``PATH`` is anything ``tformer sample`` reads: a tformer run or checkpoint, a Hugging Face folder or a GGUF file
(dequantized). The model is rebuilt in float32 from its config and its weights copied in, so a run trains a plain
:class:`~tformer.models.DecoderLM` whatever the file held; of the model settings only those that shape no weight
(:data:`CHANGEABLE`: dropout, the attention backend) may be set, and the tokenizer is the model's. The run's
checkpoints are ordinary ones: ``--resume``, ``sample``, ``explore`` and ``convert`` read them as any other run's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tformer.config import ConfigError, TransformerConfig
from tformer.models import DecoderLM
from tformer.tokenizers import HFTokenizer, Tokenizer
from tformer.training.checkpoint import CheckpointError, load_checkpoint
from tformer.training.config import MODEL_FLAGS, TrainConfig
from tformer.training.settings import flag_of

CHANGEABLE = ("dropout", "attn_backend")  # the model settings a fine-tuning run may set: they shape no weight
TOKENIZER_SETTINGS = ("tokenizer", "vocab_size", "unknown")  # the starting model's tokenizer is the run's


def check_init_from(cfg: TrainConfig) -> None:
    """``ConfigError`` (from :meth:`TrainConfig.validate`) for an ``init_from`` that does not exist (unless the run
    resumes: its checkpoint holds the weights), or with settings of the model's shape or of the tokenizer, which come
    from it."""
    from tformer.interop.shipped import SHIPPED

    if not cfg.resume and not Path(cfg.init_from).exists() and cfg.init_from not in SHIPPED:
        raise ConfigError(
            f"init_from {cfg.init_from} does not exist (--init-from); give a tformer run or checkpoint, a Hugging "
            f"Face folder, a GGUF file or a shipped model's name ({', '.join(SHIPPED)})",
            "init_from",
        )
    fixed = [name for name in cfg.model if name not in CHANGEABLE]
    if fixed:
        flags = ", ".join(MODEL_FLAGS[name].flag if name in MODEL_FLAGS else name for name in fixed)
        raise ConfigError(f"{flags}: the model's shape comes from --init-from; {_leave(fixed)}", "model")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in TOKENIZER_SETTINGS}
    changed = [name for name, value in defaults.items() if getattr(cfg, name) != value]
    if changed:
        raise ConfigError(tokenizer_refusal(changed), *changed)


def tokenizer_refusal(names: list[str]) -> str:
    """Why the tokenizer settings ``names`` are refused with ``init_from`` (here for a value changed from its
    default; the command line also for a flag given at its default)."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    flags = ", ".join(flag_of(fields[name]) for name in names)
    return f"{flags}: the tokenizer comes from --init-from; {_leave(names)}"


def _leave(names: list[str]) -> str:
    return "leave it out" if len(names) == 1 else "leave them out"


def starting_model(cfg: TrainConfig) -> tuple[DecoderLM, Tokenizer | HFTokenizer]:
    """The model (float32, on the CPU, in train mode) and tokenizer a run with ``cfg.init_from`` starts from;
    ``ValueError`` naming the path for anything that is not a decoder-only language model with a tokenizer."""
    from tformer.interop import is_pretrained, load_pretrained  # Hugging Face folders and GGUF files
    from tformer.interop.shipped import locate

    path = locate(cfg.init_from)  # a shipped model's name (smollm2): its installed file
    if is_pretrained(path):
        pretrained = load_pretrained(path, dtype=torch.float32)
        source, tokenizer = pretrained.model, pretrained.tokenizer
    else:
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as err:
            raise ValueError(f"--init-from: {err}") from None
        source, tokenizer = ckpt.model, ckpt.tokenizer
    if not isinstance(source, DecoderLM):
        raise ValueError(
            f"--init-from {path} holds {_kind(source)}; a language-model run (--data) starts from a "
            "decoder-only language model (GPT-2, Llama, Qwen2, Mistral or a tformer LM run)"
        )
    if tokenizer is None:
        raise ValueError(f"--init-from {path} has no tokenizer.json; training on text needs the model's tokenizer")
    config = starting_config(cfg, source.cfg)
    model = DecoderLM(config)
    model.load_state_dict({k: v.float() for k, v in source.state_dict().items()})
    return model.train(), tokenizer


def _kind(model: object) -> str:
    names = {"Encoder": "an encoder (a BERT model)", "EncoderDecoder": "an encoder-decoder (a translation model)"}
    return names.get(type(model).__name__, f"a {type(model).__name__}")


def starting_config(cfg: TrainConfig, source: TransformerConfig) -> TransformerConfig:
    """``source`` with the run's model settings (dropout, attention backend: the config checks that there are no
    others); ``ConfigError`` if ``cfg.block_size`` is longer than its learned positions."""
    config = dataclasses.replace(source, **cfg.model)
    if config.position == "learned" and config.max_seq_len < cfg.block_size:
        raise ConfigError(
            f"block_size={cfg.block_size} is longer than the {config.max_seq_len} learned positions of "
            f"--init-from {cfg.init_from}; use --block-size {config.max_seq_len} or less",
            "block_size",
        )
    return config


__all__ = [
    "CHANGEABLE",
    "TOKENIZER_SETTINGS",
    "check_init_from",
    "starting_config",
    "starting_model",
    "tokenizer_refusal",
]
