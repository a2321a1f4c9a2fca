"""Marian (``MarianMTModel``), the encoder-decoder closest to "Attention Is All You Need": Post-LN blocks, sinusoidal
positions in the ``[sin | cos]`` half layout (computed, not stored in the file), embeddings scaled by ``sqrt(d_model)``
(``scale_embedding``), one embedding shared by the encoder, the decoder and the tied output, a fixed
``final_logits_bias``, the configured activation, and ``decoder_start_token_id`` = the pad token.
"""

from __future__ import annotations

from typing import Any

from tformer.config import TransformerConfig
from tformer.interop.family import (
    Family,
    GenerationIds,
    activation,
    differences,
    head_dim_must_split,
    refuse,
    reverse_activation,
    setting,
)
from tformer.interop.keys import InteropError, Key, KeyTable, per_layer

SHARED = "model.shared.weight"


def _attention(ours: str, theirs: str, d_model: int) -> list[Key]:
    qkv = tuple(f"{theirs}.{n}_proj" for n in "qkv")
    rows = (d_model,) * 3
    return [
        Key(f"{ours}.in_proj.weight", tuple(n + ".weight" for n in qkv), rows),
        Key(f"{ours}.in_proj.bias", tuple(n + ".bias" for n in qkv), rows),
        Key(f"{ours}.out_proj.weight", (f"{theirs}.out_proj.weight",)),
        Key(f"{ours}.out_proj.bias", (f"{theirs}.out_proj.bias",)),
    ]


def _layer(side: str, d_model: int, cross: bool) -> list[Key]:
    ours, theirs = f"{side}.stack.blocks.{{i}}", f"model.{side}.layers.{{i}}"
    keys = _attention(f"{ours}.self_attn", f"{theirs}.self_attn", d_model)
    norms = [("self_attn_norm", "self_attn_layer_norm"), ("ff_norm", "final_layer_norm")]
    if cross:
        keys += _attention(f"{ours}.cross_attn", f"{theirs}.encoder_attn", d_model)
        norms.append(("cross_attn_norm", "encoder_attn_layer_norm"))
    for mine, hf in [("ff.up", "fc1"), ("ff.down", "fc2"), *norms]:
        keys += [Key(f"{ours}.{mine}.{p}", (f"{theirs}.{hf}.{p}",)) for p in ("weight", "bias")]
    return keys


SHAPE = dict(
    position="sinusoidal",
    pair_layout="half",
    norm="layer",
    ffn="mlp",
    norm_first=False,
    bias=True,
    qkv_bias=(None, True),
    num_kv_heads=(None,),
    tie_embeddings=True,
    type_vocab_size=0,
    embed_norm=False,
    logits_bias=True,
    pooler=False,
)


class Marian(Family):
    name, architecture, model_types, kind = "marian", "MarianMTModel", ("marian",), "seq2seq"

    def config(self, hf: dict[str, Any], source: str) -> TransformerConfig:
        d_model, heads = setting(hf, "d_model", source), setting(hf, "encoder_attention_heads", source)
        head_dim_must_split(hf, d_model, heads, source)
        for enc, dec in (
            ("encoder_attention_heads", "decoder_attention_heads"),
            ("encoder_ffn_dim", "decoder_ffn_dim"),
        ):
            refuse(
                setting(hf, dec, source) != setting(hf, enc, source),
                source,
                dec,
                hf[dec],
                f"tformer's encoder and decoder share one width ({enc}={hf[enc]})",
            )
        vocab = setting(hf, "vocab_size", source)
        refuse(
            hf.get("decoder_vocab_size", vocab) not in (None, vocab),
            source,
            "decoder_vocab_size",
            hf.get("decoder_vocab_size"),
            "the encoder and decoder share one vocabulary",
        )
        for name in ("share_encoder_decoder_embeddings", "tie_word_embeddings"):
            refuse(hf.get(name, True) is False, source, name, False, "Marian's embeddings and output are one matrix")
        refuse(bool(hf.get("normalize_before")), source, "normalize_before", True, "Marian's blocks are Post-LN")
        return TransformerConfig(
            vocab_size=vocab,
            d_model=d_model,
            num_heads=heads,
            num_layers=setting(hf, "encoder_layers", source),
            num_decoder_layers=setting(hf, "decoder_layers", source),
            d_ff=setting(hf, "encoder_ffn_dim", source),
            max_seq_len=setting(hf, "max_position_embeddings", source),
            position="sinusoidal",
            pair_layout="half",
            activation=activation(hf, "activation_function", source, "gelu"),
            norm_first=False,
            embed_scale=bool(hf.get("scale_embedding", False)),
            logits_bias=True,
            tie_embeddings=True,
            pad_id=hf.get("pad_token_id"),
        )

    def keys(self, cfg: TransformerConfig) -> KeyTable:
        keys = [
            Key("encoder.embed.tokens.weight", (SHARED,)),
            Key("logits_bias", ("final_logits_bias",), shape=(1, cfg.vocab_size)),
            *per_layer(cfg.num_layers, _layer("encoder", cfg.d_model, cross=False)),
            *per_layer(cfg.decoder_layers, _layer("decoder", cfg.d_model, cross=True)),
        ]
        tied = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")
        return KeyTable(
            keys, ignored=(r"model\.(en|de)coder\.embed_positions\.weight",), aliases=dict.fromkeys(tied, SHARED)
        )

    def mismatches(self, cfg: TransformerConfig) -> list[str]:
        return differences(cfg, SHAPE, "Marian")

    def hf_config(self, cfg: TransformerConfig, generation: GenerationIds) -> dict[str, Any]:
        pad = cfg.pad_id if cfg.pad_id is not None else generation.pad
        if pad is None:
            raise InteropError(
                "Marian's decoder starts from its pad token, and this model has none: set TransformerConfig.pad_id "
                "or pass a tokenizer with a <pad> token"
            )
        return {
            "model_type": "marian",
            "architectures": [self.architecture],
            "vocab_size": cfg.vocab_size,
            "decoder_vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model,
            "encoder_attention_heads": cfg.num_heads,
            "decoder_attention_heads": cfg.num_heads,
            "encoder_layers": cfg.num_layers,
            "decoder_layers": cfg.decoder_layers,
            "encoder_ffn_dim": cfg.d_ff,
            "decoder_ffn_dim": cfg.d_ff,
            "max_position_embeddings": cfg.max_seq_len,
            "activation_function": reverse_activation(cfg.activation, {"silu": "swish"}),
            "scale_embedding": True if cfg.embed_scale is None else cfg.embed_scale,  # None: on in a seq2seq model
            "dropout": cfg.dropout,
            "pad_token_id": pad,
            "eos_token_id": generation.eos_id,
            "decoder_start_token_id": generation.decoder_start if generation.decoder_start is not None else pad,
            "forced_eos_token_id": None,  # tformer's decoding ends at the length limit as it is: so does HF's then
            "share_encoder_decoder_embeddings": True,
            "tie_word_embeddings": True,
        }
