"""The model under evaluation: a loaded checkpoint and what the protocols need of it (how text becomes ids, the
prefix token, the longest input, the chat template).

Any model tformer loads is accepted: a Hugging Face folder, a ``.gguf`` file, a shipped model's name (``smollm2``,
``minilm``), a tformer run or checkpoint, or a :class:`tformer.interop.Pretrained` already loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tformer.evaluation.data import EvalError
from tformer.models import DecoderLM, Encoder

KIND_NAME = {"lm": "a language model", "encoder": "an embedding model (an encoder)", "seq2seq": "a seq2seq model"}


@dataclass
class EvalModel:
    """``model`` with its tokenizer; ``pretrained`` is set for checkpoints read by :mod:`tformer.interop` (the
    embedding tasks need it); ``kind`` is ``lm``, ``encoder`` or ``seq2seq``."""

    model: Any
    tokenizer: Any
    name: str
    kind: str
    bos: int | None = None
    eos: int | None = None
    pretrained: Any = None

    def encode(self, text: str) -> list[int]:
        """``text`` as ids, as the Hugging Face tokenizer's ``encode`` does by default (lm-eval's ``tok_encode``)."""
        return list(self.tokenizer.encode(text))

    @property
    def prefix(self) -> int:
        """The token an empty context becomes (lm-eval's ``prefix_token_id``): BOS, else EOS."""
        token = self.bos if self.bos is not None else self.eos
        if token is None:
            raise EvalError(f"{self.name}: its tokenizer has neither a BOS nor an EOS token to condition on")
        return token

    @property
    def max_length(self) -> int:
        return int(self.model.cfg.max_seq_len)

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_id", None)
        return pad if isinstance(pad, int) else (self.eos or 0)

    def require(self, kind: str, task: str) -> None:
        """:class:`EvalError` naming the model's kind when ``task`` needs another."""
        if self.kind != kind:
            fix = "use sts:FILE with an encoder (minilm)" if kind == "encoder" else "give a decoder LM (smollm2)"
            raise EvalError(f"task {task} needs {KIND_NAME[kind]}; {self.name} is {KIND_NAME[self.kind]}: {fix}")


def _kind(model: Any) -> str:
    if isinstance(model, DecoderLM):
        return "lm"
    return "encoder" if isinstance(model, Encoder) else "seq2seq"


def from_pretrained(pretrained: Any, name: str | None = None) -> EvalModel:
    """An :class:`EvalModel` of a :class:`tformer.interop.Pretrained`."""
    if pretrained.tokenizer is None:
        raise EvalError(f"{pretrained.path}: no tokenizer beside the weights; evaluation reads text")
    gen = pretrained.generation
    eos = gen.eos_id if gen.eos_id is not None else pretrained.tokenizer.eos_id
    bos = gen.bos if gen.bos is not None else pretrained.tokenizer.bos_id
    return EvalModel(
        pretrained.model.eval(),
        pretrained.tokenizer,
        name or str(pretrained.path),
        _kind(pretrained.model),
        bos,
        eos,
        pretrained,
    )


def load(checkpoint: Any, *, device: str = "cpu", dtype: str | None = None) -> EvalModel:
    """The model at ``checkpoint`` (module docstring), or ``checkpoint`` itself when it is already loaded."""
    import torch

    from tformer.interop import Pretrained, is_pretrained, load_pretrained, shipped
    from tformer.runtime import resolve_device

    if isinstance(checkpoint, EvalModel):
        return checkpoint
    if isinstance(checkpoint, Pretrained):
        return from_pretrained(checkpoint)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise EvalError(
            f"checkpoint must be a path, a shipped model's name or a Pretrained; got {type(checkpoint).__name__}"
        )
    path = shipped.locate(checkpoint)
    if not path.exists():
        raise EvalError(shipped.missing(checkpoint))
    torch_dtype = None if dtype is None else getattr(torch, dtype)
    if is_pretrained(path):
        return from_pretrained(load_pretrained(path, dtype=torch_dtype, device=resolve_device(device)), str(checkpoint))
    return _load_run(Path(path), str(checkpoint), device, torch_dtype)


def _load_run(path: Path, name: str, device: str, dtype: Any) -> EvalModel:
    """A tformer run or checkpoint (``tformer train``): its model and tokenizer."""
    from tformer.engine import accelerate
    from tformer.runtime import resolve_device
    from tformer.training.resume import load_newest

    ckpt = load_newest(str(path), map_location=resolve_device(device))
    if dtype is not None:
        ckpt.model.to(dtype)
    accelerate(ckpt.model)
    eos, start = ckpt.special_ids()
    tok = ckpt.tokenizer
    return EvalModel(ckpt.model.eval(), tok, name, _kind(ckpt.model), start, eos[0] if eos else None)
