"""Tiny tformer models of each family the hook points must cover, with random weights at unit scale, and inputs.

Sizes are chosen pairwise different where a shape could mix them up: ``B=2, T=5`` (an encoder-decoder's target),
``S=7`` (its source), ``C=32, F=48, V=41, H=4, D=8``, and ``Hkv=2`` in the grouped-query family. Weights are drawn
at unit scale (as ``tests/interop/hf_models.py`` does for Hugging Face's): matrices std ``1/sqrt(fan_in)``, norm
gains ``1 + 0.5 N(0, 1)``, biases ``0.2 N(0, 1)``, embeddings std 1, so every component of the residual stream is
of order 1 and a wrong term shows.
"""

from __future__ import annotations

import torch
from torch import nn

from tformer import DecoderLM, EncoderDecoder, TransformerConfig
from tformer.layers import LayerNorm, RMSNorm
from tformer.models import Encoder

B, T, S = 2, 5, 7
SIZES = dict(vocab_size=41, d_model=32, num_heads=4, num_layers=2, d_ff=48, max_seq_len=64)

# family -> (model class, config changes)
FAMILIES: dict[str, tuple[type, dict]] = {
    "gpt2": (DecoderLM, dict(position="learned", activation="gelu_tanh")),
    "llama": (
        DecoderLM,
        dict(
            position="rotary",
            norm="rms",
            ffn="gated",
            activation="silu",
            num_kv_heads=2,
            bias=False,
            pair_layout="half",
            tie_embeddings=False,
        ),
    ),
    "post_ln": (DecoderLM, dict(position="sinusoidal", norm_first=False)),
    "bert": (
        Encoder,
        dict(position="learned", norm_first=False, type_vocab_size=2, embed_norm=True, activation="gelu"),
    ),
    "marian_post": (
        EncoderDecoder,
        dict(position="sinusoidal", norm_first=False, activation="silu", pair_layout="half"),
    ),
    "marian_pre": (EncoderDecoder, dict(position="sinusoidal", norm_first=True, activation="silu")),
}
LMS = [name for name, (cls, _) in FAMILIES.items() if cls is DecoderLM]
STACKS = [name for name, (cls, _) in FAMILIES.items() if cls is not EncoderDecoder]  # one stack: LMs and the encoder


def config(family: str) -> TransformerConfig:
    return TransformerConfig(**{**SIZES, **FAMILIES[family][1]})


def unit_scale(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` in eval mode with its weights redrawn at unit scale (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
                if isinstance(module, nn.Embedding):
                    p.copy_(noise)
                elif p.dim() >= 2:
                    p.copy_(noise * p.shape[1] ** -0.5)
                elif isinstance(module, (LayerNorm, RMSNorm)) and name == "weight":
                    p.copy_(1.0 + 0.5 * noise)
                else:
                    p.copy_(0.2 * noise)
    return model.eval()


def tiny(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """A tiny model of ``family`` in eval mode, in ``dtype``."""
    cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return unit_scale(cls(config(family)).to(dtype), seed)


def ids(batch: int = B, length: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def inputs(family: str, seed: int = 0) -> tuple:
    """The positional arguments of one forward: ``(ids,)``; the encoder's ``(ids, None, token_types)``; the
    encoder-decoder's ``(src_ids (B, S), tgt_ids (B, T))``."""
    cls, _ = FAMILIES[family]
    if cls is Encoder:
        types = torch.randint(0, 2, (B, T), generator=torch.Generator().manual_seed(seed + 1))
        return ids(seed=seed), None, types
    if cls is EncoderDecoder:
        return ids(length=S, seed=seed), ids(seed=seed + 1)
    return (ids(seed=seed),)


def body(model: nn.Module):
    """The one stack of blocks of a language model or an encoder."""
    return model.decoder if isinstance(model, DecoderLM) else model
