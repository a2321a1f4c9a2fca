"""GGUF files (llama.cpp's format) of the ``llama`` architecture, read and dequantized with the ``gguf`` package.

Three things differ from a Hugging Face directory, and are undone here:

* tensor names: ``blk.N.attn_q.weight`` is ``model.layers.N.self_attn.q_proj.weight`` and so on (``NAMES``);
* the Q and K rows: llama.cpp's converter permutes each head's rows so that its RoPE can rotate adjacent pairs
  (``(x_0, x_1), (x_2, x_3)...``) where Hugging Face's rotates halves (``(x_i, x_{i+D/2})``). :func:`unpermute`
  restores Hugging Face's order, so the model is the same one ``transformers`` builds from the file;
* the hyper-parameters and the tokenizer live in the metadata (``llama.embedding_length``, ``tokenizer.ggml.*``).

The tokenizer: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE) from the file's tokens and merges, with the
pre-tokenizer that ``tokenizer.ggml.pre`` names. ``transformers``' GGUF loader ignores ``pre`` and splits with GPT-2's
rule alone; tformer follows the file, as llama.cpp does: for ``smollm`` every digit is split off first (llama.cpp's
``\\p{N}`` pass, the ``Digits`` step of SmolLM2's own ``tokenizer.json``), then GPT-2's rule runs on the pieces. The
ids differ only where a digit follows two or more whitespace characters: ``"x  1"`` is ``x, "ĠĠ", 1`` here and
``x, "Ġ", "Ġ", 1`` in ``transformers`` (SmolLM2's vocabulary has no token of a digit and anything else).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tformer.interop.keys import InteropError

NAMES = {  # GGUF tensor name (per layer: blk.{i}.) -> Hugging Face's
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
CONTROL = 3  # tokenizer.ggml.token_type of special (control) tokens


def unpermute(weight: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's ``permute``: per head, rows ``(j, half)`` back to ``(half, j)``: ``(H*D, C) -> (H*D, C)``."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute(weight: Tensor, heads: int) -> Tensor:
    """llama.cpp's ``permute`` (the inverse of :func:`unpermute`)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


MAGIC = b"GGUF"  # the first four bytes of every GGUF file


def has_gguf_magic(path: Path) -> bool:
    """Whether the file ``path`` begins with GGUF's magic bytes: four bytes read, nothing parsed (``False`` for a
    file that cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class GGUFFile:
    """The metadata and tensors of a GGUF file."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(path)
        except Exception as err:  # the reader raises ValueError, struct.error, ... for a damaged file
            raise InteropError(f"{path}: not a readable GGUF file (truncated or damaged?): {err}") from None
        self.path = path

    def field(self, name: str, default: Any = None) -> Any:
        f = self.reader.fields.get(name)
        if f is None:
            return default
        return f.contents()

    def required(self, name: str) -> Any:
        value = self.field(name)
        if value is None:
            raise InteropError(f"{self.path}: the metadata lacks {name}")
        return value

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor, dequantized to float32, in torch's ``(out, in)`` layout."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = {}
        for t in self.reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
                array = (
                    np.asarray(t.data, dtype=np.float32)
                    if t.tensor_type != GGMLQuantizationType.BF16
                    else (dequantize(t.data, t.tensor_type))
                )
            else:
                try:
                    array = dequantize(t.data, t.tensor_type)
                except NotImplementedError:
                    raise InteropError(
                        f"{self.path}: {t.name} is stored as {t.tensor_type.name}, which the gguf "
                        "package cannot dequantize"
                    ) from None
            out[t.name] = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a copy: writable
        return out


def shortest(value: float) -> float:
    """A float32 field as the shortest decimal that reads back as the same float32 (the file's 1e-5 is stored as
    9.99999975e-06; config.json then says 1e-05, and float32 arithmetic sees the same number either way)."""
    return float(str(np.float32(value)))


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face Llama model with the file's hyper-parameters."""
    arch = file.required("general.architecture")
    if arch != "llama":
        raise InteropError(
            f"{file.path}: general.architecture={arch!r} is not supported: tformer reads GGUF files of "
            "the llama architecture"
        )
    d_model, heads = int(file.required("llama.embedding_length")), int(file.required("llama.attention.head_count"))
    rope_dims = file.field("llama.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != d_model // heads:
        raise InteropError(
            f"{file.path}: llama.rope.dimension_count={rope_dims} is not supported: tformer rotates "
            f"whole heads of {d_model // heads}"
        )
    scaling = file.field("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise InteropError(
            f"{file.path}: llama.rope.scaling.type={scaling!r} is not supported: tformer implements "
            "the unscaled RoPE only"
        )
    factor = file.field("llama.rope.scaling.factor")
    if factor not in (None, 1, 1.0):
        raise InteropError(
            f"{file.path}: llama.rope.scaling.factor={factor} is not supported: tformer implements the unscaled "
            "RoPE only"
        )
    tokens = file.field("tokenizer.ggml.tokens")
    names = {t.name for t in file.reader.tensors}
    embedding = next((t for t in file.reader.tensors if t.name == "token_embd.weight"), None)
    rows = int(embedding.n_elements) // d_model if embedding is not None else 0  # without tokenizer metadata
    return {
        "model_type": "llama",
        "vocab_size": int(file.field("llama.vocab_size") or len(tokens or ()) or rows),
        "hidden_size": d_model,
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.field("llama.attention.head_count_kv", heads)),
        "num_hidden_layers": int(file.required("llama.block_count")),
        "intermediate_size": int(file.required("llama.feed_forward_length")),
        "max_position_embeddings": int(file.field("llama.context_length", 2048)),
        "rope_theta": shortest(file.field("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": shortest(file.field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": file.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": file.field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": file.field("tokenizer.ggml.padding_token_id"),
    }


def hf_tensors(file: GGUFFile, config: dict[str, Any]) -> dict[str, Tensor]:
    """The file's tensors under Hugging Face's names, Q and K rows in Hugging Face's order."""
    out = {}
    for name, tensor in file.tensors().items():
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        base = match.group(2) if match else name
        if base not in NAMES:
            raise InteropError(f"{file.path}: the tensor {name} has no place in a llama model")
        hf_name = f"model.layers.{match.group(1)}.{NAMES[base]}" if match else NAMES[base]
        if base == "attn_q.weight":
            tensor = unpermute(tensor, config["num_attention_heads"])
        elif base == "attn_k.weight":
            tensor = unpermute(tensor, config["num_key_value_heads"])
        out[hf_name] = tensor
    return out


def tokenizer(file: GGUFFile, config: dict[str, Any]):
    """The file's byte-level BPE tokenizer (``tokenizer.ggml.model = "gpt2"``), or ``None`` without one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from tformer.tokenizers import HFTokenizer

    kind = file.field("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise InteropError(
            f"{file.path}: tokenizer.ggml.model={kind!r} is not supported: tformer builds byte-level "
            "BPE ('gpt2') tokenizers from GGUF metadata"
        )
    pre = file.field("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = {
        "default": byte_level,
        "gpt2": byte_level,
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
    }
    if pre not in splits:
        raise InteropError(
            f"{file.path}: tokenizer.ggml.pre={pre!r} is not supported: tformer knows {', '.join(splits)}"
        )
    tokens = list(file.required("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in file.required("tokenizer.ggml.merges")]
    hf = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    hf.pre_tokenizer = splits[pre]
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    types = list(file.field("tokenizer.ggml.token_type", ()))
    hf.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if int(t) == CONTROL]
    )
    bos, eos, pad = config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]
    if file.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return HFTokenizer(hf, bos_id=bos, eos_id=eos, pad_id=pad)


CACHE_VERSION = 1


def convert_gguf(path: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the Hugging Face model directory of the GGUF file ``path`` at ``out``: ``config.json``,
    ``model.safetensors`` (dequantized to float32, stored in ``dtype``; Hugging Face's names and Q/K order),
    ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template) and ``generation_config.json``.
    What ``transformers`` would load from the file, in its own format."""
    from tformer.interop import family_of
    from tformer.interop.hf import SPECIAL_IDS, write_directory

    file = GGUFFile(path)
    config = hf_config(file)
    cfg = family_of(config, str(path)).config(config, str(path))  # refuses unsupported settings before any work
    tensors = {name: t.to(dtype) for name, t in hf_tensors(file, config).items()}
    generation = {k: config[k] for k in SPECIAL_IDS if config[k] is not None}
    hf_cfg = {
        **{k: v for k, v in config.items() if v is not None},
        "architectures": ["LlamaForCausalLM"],
        "head_dim": cfg.head_dim,
        "dtype": str(dtype).removeprefix("torch."),
    }
    return write_directory(out, hf_cfg, tensors, generation, tokenizer(file, config), tokenizer_config(file, config))


def tokenizer_config(file: GGUFFile, config: dict[str, Any]) -> dict[str, Any] | None:
    """``tokenizer_config.json`` for the file's tokenizer: its special tokens by name and its chat template (what
    ``transformers.AutoTokenizer`` reads besides ``tokenizer.json``: without it, a converted directory's tokenizer
    has no eos, bos or pad token and no chat template). ``None`` for a file without a tokenizer."""
    from tformer.interop.hf import SPECIAL_IDS, special_tokens

    tokens = file.field("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    tokens = list(tokens)
    unknown = file.field("tokenizer.ggml.unknown_token_id")
    ids = {**{k: config[k] for k in SPECIAL_IDS}, "unk_token_id": None if unknown is None else int(unknown)}
    out: dict[str, Any] = special_tokens(tokens.__getitem__, ids)
    template = file.field("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = str(template)
    out["add_bos_token"] = bool(file.field("tokenizer.ggml.add_bos_token", False))
    return out


def cache_folder(path: Path) -> Path:
    """Where :func:`cached_directory` keeps the conversion of ``path`` (``$TFORMER_CACHE``, else
    ``~/.cache/tformer``, then ``gguf/``), under a name that changes when the file does (its path, size and
    modification time)."""
    import hashlib

    from tformer.runtime import default_cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{CACHE_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return default_cache_dir() / "gguf" / f"{path.stem}-{key}"


def is_cached(path: Path) -> bool:
    """Whether ``path`` has a converted directory in the cache (a load reads it instead of converting)."""
    return (cache_folder(path) / "config.json").is_file()


def cached_directory(path: Path) -> Path:
    """The converted directory of ``path`` in tformer's cache (:func:`cache_folder`), converted on first use: a
    second load reads safetensors instead of dequantizing again."""
    folder = cache_folder(path)
    if not (folder / "config.json").is_file():
        try:
            convert_gguf(path, folder)
        except (InteropError, OSError):
            if not (folder / "config.json").is_file():  # not just another process that converted it first
                raise
    return folder


def _discard(folder: Path) -> None:
    """Remove a cached conversion: renamed out of the way first (one step, so no load sees half of it), then deleted."""
    import shutil
    import uuid

    aside = folder.with_name(f".tmp-discarded-{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        folder.rename(aside)
    except FileNotFoundError:  # another process discarded it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def load_gguf(path: Path):
    """A :class:`tformer.interop.Pretrained` of a GGUF file: a :class:`tformer.DecoderLM` in float32 (through the
    cached conversion of :func:`cached_directory`; without a writable cache, converted in a temporary folder)."""
    import tempfile

    from tformer.interop import _load_directory
    from tformer.interop.hf import UnwritableFolder

    try:
        folder = cached_directory(path)
    except (OSError, UnwritableFolder):  # no writable cache: convert for this load only
        with tempfile.TemporaryDirectory() as tmp:
            pretrained = _load_directory(convert_gguf(path, Path(tmp) / "model"))
            pretrained.path = path
            return pretrained
    try:
        pretrained = _load_directory(folder)
    except InteropError as err:  # the cached files were damaged (a full disk, an edit): convert again, once
        message = f"{folder}: the cached conversion of {path} could not be read ({err}); converting it again"
        warnings.warn(message, RuntimeWarning, stacklevel=3)  # at load_pretrained's caller
        _discard(folder)
        pretrained = _load_directory(cached_directory(path))
    pretrained.path, pretrained.family = path, "llama"
    return pretrained
