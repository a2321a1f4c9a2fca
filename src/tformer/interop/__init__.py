"""Pretrained models in and out: Hugging Face directories and GGUF files computed by tformer's own Transformer.

``load_pretrained(path)`` reads a Hugging Face model directory (``config.json`` and safetensors weights) or a GGUF
file (llama.cpp's format) into a :class:`tformer.DecoderLM`, :class:`tformer.Encoder` or
:class:`tformer.EncoderDecoder`;
``save_pretrained(model, path)`` writes a directory that ``transformers.AutoModel...from_pretrained`` loads with no
missing, unexpected or mismatched keys. Families: :mod:`.gpt2`, :mod:`.bert`, :mod:`.llama` (Llama, Qwen2, Mistral),
:mod:`.marian`; each maps its config and its tensors (one key table, read both ways: :mod:`.keys`).

Shapes: B, T, C (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import TransformerConfig
from tformer.engine import accelerate, pack_weights
from tformer.interop import hf, shipped
from tformer.interop.bert import Bert
from tformer.interop.family import Family, GenerationIds
from tformer.interop.gpt2 import GPT2
from tformer.interop.keys import InteropError
from tformer.interop.llama import Llama, Mistral, Qwen2
from tformer.interop.marian import Marian
from tformer.models import DecoderLM, Encoder, EncoderDecoder, pad_right
from tformer.tokenizers import TOKENIZER_FILE, HFTokenizer, Tokenizer

FAMILIES: dict[str, Family] = {
    t: f for f in (GPT2(), Bert(), Llama(), Qwen2(), Mistral(), Marian()) for t in f.model_types
}
MODEL_CLASSES = {"lm": DecoderLM, "encoder": Encoder, "seq2seq": EncoderDecoder}


@dataclass
class Pretrained:
    """A loaded pretrained model: the tformer ``model`` (eval mode), its ``tokenizer`` (or ``None``), the special ids
    of ``generation``, the ``family`` name, the source's ``config`` (``config.json``, or the GGUF metadata mapped onto
    one) and ``path``; ``max_length`` the longest input a sentence-embedding model was trained on (or ``None``)."""

    model: nn.Module
    tokenizer: HFTokenizer | None
    generation: GenerationIds
    family: str
    config: dict[str, Any] = field(repr=False)
    path: Path
    max_length: int | None = None


def family_of(config: dict[str, Any], source: str) -> Family:
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise InteropError(f"{source}: model_type {kind!r} is not supported; tformer loads {', '.join(FAMILIES)}")
    return FAMILIES[kind]


def build(family: Family, cfg: TransformerConfig, tensors: dict[str, Tensor], source: str) -> nn.Module:
    """The tformer model of ``cfg`` holding ``tensors`` (HF names); every tensor used or ignored, every one of the
    model's filled (tied tensors through the one they share)."""
    cfg = family.fit(cfg, set(family.rename(tensors)))
    with torch.device("meta"):  # no memory, no initialization: every tensor comes from the file
        model = MODEL_CLASSES[family.kind](cfg)
    model.to_empty(device="cpu")  # storage for the weights; the position tables are computed here
    expected = model.state_dict()
    state = family.keys(cfg).to_tformer(family.rename(tensors), expected, source)
    filled = {name: t.data_ptr() for name, t in expected.items() if name in state}
    for name, t in expected.items():
        if name not in state and t.data_ptr() not in filled.values():
            raise InteropError(f"{source}: nothing in the file fills tformer's {name}")
    dtype = hf.file_dtype(tensors)
    model.to(dtype)
    model.load_state_dict(state, strict=False)
    return model


def is_pretrained(path: str | os.PathLike) -> bool:
    """``path`` is a GGUF file or a Hugging Face model directory, or the name of a model tformer ships
    (:mod:`.shipped`: ``smollm2``, ``minilm``), installed or not (else: a tformer run or checkpoint)."""
    p = Path(path)
    if not p.exists() and str(path) in shipped.SHIPPED:
        return True
    return (p.suffix == ".gguf" and not p.is_dir()) or (p / hf.CONFIG).is_file()


def load_pretrained(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> Pretrained:
    """Load a Hugging Face model directory or a ``.gguf`` file, or a model tformer ships by its name (``"smollm2"``,
    ``"minilm"``: the files of the installed packages of ``models.txt``; a path that exists wins). ``dtype=None``
    keeps the file's dtype (a GGUF file's quantized tensors are dequantized to float32). The model is accelerated
    (:func:`tformer.engine.accelerate`) and on the CPU its weights end in one block of memory
    (:func:`tformer.engine.memory.pack_weights`). ``InteropError`` (a ``ValueError``) names the file or the field for
    anything missing, truncated, unexpected or unsupported."""
    dtype = _as_dtype(dtype)
    if device is not None and not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise InteropError(f"device={device!r} is not a torch device; use e.g. 'cpu' or 'cuda'") from None
    if device is not None:
        _check_device(device)
    path = shipped.locate(path)  # a name (smollm2, minilm): the installed package's file
    if not path.exists():
        raise InteropError(shipped.missing(path))
    if path.is_file() and path.suffix == ".gguf":
        from tformer.interop.gguf import load_gguf

        pretrained = load_gguf(path)
    elif path.is_dir():
        pretrained = _load_directory(path)
    else:
        raise InteropError(f"{path}: neither a Hugging Face model directory (with {hf.CONFIG}) nor a .gguf file")
    if dtype is not None:
        pretrained.model.to(dtype)
    if device is not None:
        pretrained.model.to(device)
    pretrained.model.eval()
    pack_weights(accelerate(pretrained.model))  # kernels where they pay; weights in one block: read faster
    return pretrained


def _load_directory(path: Path) -> Pretrained:
    if not (path / hf.CONFIG).is_file():
        run = " (it is a tformer run: load it with tformer.load_checkpoint)" if (path / "checkpoints").is_dir() else ""
        raise InteropError(f"{path}: no {hf.CONFIG}, so not a Hugging Face model directory{run}")
    config = hf.read_json(path / hf.CONFIG)
    source = str(path / hf.CONFIG)
    family = family_of(config, source)
    cfg = family.config(config, source)
    model = build(family, cfg, hf.read_tensors(path), str(path))
    generation_file = path / hf.GENERATION
    generation = hf.generation_ids(
        config,
        hf.read_json(generation_file) if generation_file.is_file() else None,
        f"{path} ({hf.CONFIG} or {hf.GENERATION})",
    )
    tokenizer = None
    if (path / TOKENIZER_FILE).is_file():
        settings = path / hf.TOKENIZER_CONFIG
        tokenizer = HFTokenizer.from_file(
            path / TOKENIZER_FILE,
            bos_id=generation.bos,
            eos_id=generation.eos_id,
            pad_id=generation.pad,
            settings=hf.read_json(settings) if settings.is_file() else None,
        )
    max_length = None
    if (path / "sentence_bert_config.json").is_file():
        max_length = hf.read_json(path / "sentence_bert_config.json").get("max_seq_length")
    return Pretrained(model, tokenizer, generation, family.name, config, path, max_length)


def family_for(model: nn.Module) -> Family:
    """The family that can represent ``model``; ``ValueError`` naming the fields that fit none."""
    from tformer.runtime import unwrap

    model = unwrap(model)
    kind = next((k for k, cls in MODEL_CLASSES.items() if type(model) is cls), None)
    if kind is None:
        raise InteropError(
            f"a {type(model).__name__} cannot be exported; tformer exports DecoderLM, Encoder and EncoderDecoder"
        )
    candidates = [f for f in dict.fromkeys(FAMILIES.values()) if f.kind == kind]
    reasons = {f.name: f.mismatches(model.cfg) for f in candidates}
    fits = [f for f in candidates if not reasons[f.name]]
    if fits:
        return fits[0]
    closest = min(reasons, key=lambda name: len(reasons[name]))
    raise InteropError(
        f"this {type(model).__name__} matches no Hugging Face family; closest: {closest}, but "
        f"{'; '.join(reasons[closest])}"
    )


def _check_device(device: torch.device) -> None:
    """``InteropError`` for a device this machine lacks, before anything is loaded (torch would fail after the load,
    with an ``AssertionError``)."""
    from tformer.runtime import unavailable

    if device.type == "meta":
        raise InteropError("device='meta' holds no data: the weights would be dropped; use 'cpu' or 'cuda'")
    missing = unavailable(device)
    if missing is not None:
        why, instead = missing
        raise InteropError(f"device={str(device)!r} is not available here{why}; use device={instead!r}")


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a ``torch.dtype``: one, its name (``"bfloat16"``, ``"torch.bfloat16"``) or ``None``."""
    if dtype is None:
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and not isinstance(found, torch.dtype):
        raise InteropError(
            f"dtype={dtype!r} is not the name of a torch dtype; use 'float32', 'bfloat16', 'float16' or 'float64' "
            "(or torch.bfloat16, ...)"
        )
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise InteropError(
            f"dtype={dtype!r} is not a floating-point dtype; use e.g. torch.bfloat16 or 'float32' (for int8 weights, "
            "tformer.quantize(pretrained.model, 'int8') after loading)"
        )
    return found


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    tokenizer: Any | None = None,
    generation: GenerationIds | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face model directory at ``path`` (``config.json``, ``model.safetensors``,
    ``generation_config.json``, and for a tokenizer with a Hugging Face form ``tokenizer.json`` and
    ``tokenizer_config.json``, its special tokens). The special ids are ``generation``'s (pass
    ``pretrained.generation`` to keep a model's several end-of-sequence ids), else the tokenizer's.
    ``InteropError`` names the config field when the model fits no family; nothing is written then."""
    from tformer.engine.quantization import is_quantized
    from tformer.runtime import unwrap

    if isinstance(model, Pretrained):
        raise TypeError(
            "save_pretrained takes the model: pass pretrained.model (and tokenizer=pretrained.tokenizer), not the "
            "Pretrained that load_pretrained returns"
        )
    if not isinstance(model, nn.Module):
        hint = " (pass its .model)" if isinstance(getattr(model, "model", None), nn.Module) else ""
        raise TypeError(f"save_pretrained takes a tformer model (an nn.Module); got {type(model).__name__}{hint}")
    model = unwrap(model)
    if is_quantized(model):
        raise InteropError(
            "a quantized (int8) model cannot be exported: Hugging Face's formats hold float weights; save the model "
            "before tformer.quantize"
        )
    if tokenizer is not None and not isinstance(tokenizer, (Tokenizer, HFTokenizer)):
        raise TypeError(
            f"save_pretrained takes tformer's tokenizer (pretrained.tokenizer, or a run's); got a "
            f"{type(tokenizer).__name__} (a transformers tokenizer saves itself: its save_pretrained(path))"
        )
    family = family_for(model)
    generation = generation or _generation_of(tokenizer)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tensors = family.keys(model.cfg).to_hf(state)
    dtype = hf.file_dtype(tensors)
    config = {**family.hf_config(model.cfg, generation), "dtype": str(dtype).removeprefix("torch.")}
    # None drops a field, except the special ids: absent, transformers would take its class's default (GPT-2's 50256)
    config = {k: v for k, v in config.items() if v is not None or k in hf.SPECIAL_IDS}
    gen = {
        k: v
        for k, v in {
            "bos_token_id": generation.bos,
            "pad_token_id": generation.pad,
            "eos_token_id": list(generation.eos) if len(generation.eos) > 1 else generation.eos_id,
            "decoder_start_token_id": config.get("decoder_start_token_id", generation.decoder_start),  # Marian: pad
        }.items()
        if v is not None
    }
    tok = _hf_tokenizer(tokenizer)
    ids = dict(zip(hf.SPECIAL_IDS, (generation.bos, generation.eos_id, generation.pad), strict=True))
    # the loaded tokenizer_config.json (chat template, unknown token, ...), its special tokens those of `generation`
    settings = tok and {**tok.settings, **hf.special_tokens(tok.token, ids)}
    return hf.write_directory(Path(path), config, tensors, gen, tok, settings)


def _generation_of(tokenizer: Any | None) -> GenerationIds:
    if tokenizer is None:
        return GenerationIds()
    eos = getattr(tokenizer, "eos_id", None)
    return GenerationIds(
        getattr(tokenizer, "bos_id", None), () if eos is None else (eos,), getattr(tokenizer, "pad_id", None)
    )


def _hf_tokenizer(tokenizer: Any | None) -> HFTokenizer | None:
    """A tokenizer with a ``tokenizer.json`` form (Hugging Face's, or tformer's BPE), else ``None``."""
    if tokenizer is None or isinstance(tokenizer, HFTokenizer):
        return tokenizer
    inner = getattr(tokenizer, "_hf", None)
    return HFTokenizer(inner) if inner is not None else None


@torch.inference_mode()
def embed(pretrained: Pretrained, texts: Iterable[str], *, batch_size: int = 32) -> Tensor:
    """Sentence embeddings ``(N, C)`` as sentence-transformers computes them: the encoder's last hidden states averaged
    over each text's real tokens (mask-weighted mean pooling), then L2-normalized. Texts longer than the model's
    ``max_length`` (sentence-transformers' ``max_seq_length``; else the position table) are truncated."""
    check_embedder(pretrained)
    texts = _texts(texts)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    model, tokenizer = pretrained.model, pretrained.tokenizer
    limit = pretrained.max_length or model.cfg.max_seq_len
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(texts), batch_size):
        encoded = [_truncate(ids, limit) for ids in tokenizer.encode_batch(texts[start : start + batch_size])]
        ids, mask = pad_right(encoded, tokenizer.pad_id or 0)
        ids, mask = ids.to(device), mask.to(device)
        padded = len({len(row) for row in encoded}) > 1  # known from the lists: no read from the device
        hidden = model(ids, mask if padded else None)  # (B, T, C); no padding: no mask (the unmasked kernels)
        weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # (B, C)
        out.append(F.normalize(mean.float(), p=2, dim=-1))
    return torch.cat(out) if out else torch.empty(0, model.cfg.d_model)


def _texts(texts: Any) -> list[str]:
    """``texts`` as a list of strings that UTF-8 can encode: ``TypeError`` naming a value that is not a string,
    ``ValueError`` naming a string with a lone surrogate (the tokenizer cannot take it)."""
    if isinstance(texts, str | bytes) or not isinstance(texts, Iterable):
        raise TypeError(f"texts must be a list of strings; got a {type(texts).__name__} (wrap one text: [text])")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts must be strings; texts[{i}] is a {type(text).__name__}: {text!r:.60}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"texts[{i}] is not Unicode text: {text[err.start]!r} at index {err.start} is a lone surrogate"
            ) from None
    return texts


def check_embedder(pretrained: Pretrained) -> None:
    """``InteropError`` unless ``pretrained`` can embed sentences: an encoder with a tokenizer (a BERT model)."""
    if not isinstance(pretrained, Pretrained):
        raise TypeError(
            f"embed needs what tformer.load_pretrained returns (a Pretrained: model and tokenizer); got "
            f"{type(pretrained).__name__}"
        )
    if not isinstance(pretrained.model, Encoder):
        raise InteropError(
            f"{pretrained.path}: sentence embeddings need an encoder with a tokenizer (a BERT model); this is a "
            f"{pretrained.family} model"
        )
    if pretrained.tokenizer is None:
        raise InteropError(
            f"{pretrained.path}: no tokenizer.json, and sentence embeddings need the model's tokenizer: put the "
            "tokenizer.json the model was trained with beside its weights"
        )


def _truncate(ids: list[int], limit: int) -> list[int]:
    """At most ``limit`` ids, keeping the last (``[SEP]``) one, as the tokenizer's truncation would."""
    return ids if len(ids) <= limit else [*ids[: limit - 1], ids[-1]]


__all__ = [
    "FAMILIES",
    "GenerationIds",
    "HFTokenizer",
    "InteropError",
    "Pretrained",
    "check_embedder",
    "embed",
    "family_for",
    "is_pretrained",
    "load_pretrained",
    "save_pretrained",
]
