"""BERT (``BertModel``): Post-LN blocks, learned positions and token types summed and normalized (LayerNorm, eps
1e-12), the exact GELU, and the pooler (``tanh`` of a dense layer on ``[CLS]``). It loads as a :class:`tformer.Encoder`
whose forward ``(ids, mask, token_type_ids)`` gives the last hidden states.

q, k and v are three HF tensors, concatenated into tformer's ``in_proj``. Files of the ``BertFor...`` classes (a
``bert.`` prefix) load too; their task heads (``cls.``, ``classifier.``, ``qa_outputs.``) are ignored, as is the
``position_ids`` buffer of old files, and a file without the pooler (``BertForMaskedLM``) loads without one.
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
from tformer.interop.keys import Key, KeyTable, per_layer

L = "encoder.layer.{i}."
B = "stack.blocks.{i}."


def _layer(d_model: int) -> list[Key]:
    qkv = tuple(f"{L}attention.self.{name}" for name in ("query", "key", "value"))
    rows = (d_model,) * 3
    return [
        Key(B + "self_attn.in_proj.weight", tuple(n + ".weight" for n in qkv), rows),
        Key(B + "self_attn.in_proj.bias", tuple(n + ".bias" for n in qkv), rows),
        Key(B + "self_attn.out_proj.weight", (L + "attention.output.dense.weight",)),
        Key(B + "self_attn.out_proj.bias", (L + "attention.output.dense.bias",)),
        Key(B + "self_attn_norm.weight", (L + "attention.output.LayerNorm.weight",)),
        Key(B + "self_attn_norm.bias", (L + "attention.output.LayerNorm.bias",)),
        Key(B + "ff.up.weight", (L + "intermediate.dense.weight",)),
        Key(B + "ff.up.bias", (L + "intermediate.dense.bias",)),
        Key(B + "ff.down.weight", (L + "output.dense.weight",)),
        Key(B + "ff.down.bias", (L + "output.dense.bias",)),
        Key(B + "ff_norm.weight", (L + "output.LayerNorm.weight",)),
        Key(B + "ff_norm.bias", (L + "output.LayerNorm.bias",)),
    ]


SHAPE = dict(
    position="learned",
    norm="layer",
    ffn="mlp",
    norm_first=False,
    bias=True,
    qkv_bias=(None, True),
    num_kv_heads=(None,),
    embed_norm=True,
    embed_scale=False,
    logits_bias=False,
    pooler=True,
)


class Bert(Family):
    name, architecture, model_types, kind = "bert", "BertModel", ("bert",), "encoder"

    def config(self, hf: dict[str, Any], source: str) -> TransformerConfig:
        d_model, heads = setting(hf, "hidden_size", source), setting(hf, "num_attention_heads", source)
        head_dim_must_split(hf, d_model, heads, source)
        kind = setting(hf, "position_embedding_type", source, "absolute")
        refuse(kind != "absolute", source, "position_embedding_type", kind, "tformer's BERT has absolute positions")
        refuse(bool(hf.get("is_decoder")), source, "is_decoder", True, "BERT loads as an encoder")
        return TransformerConfig(
            vocab_size=setting(hf, "vocab_size", source),
            d_model=d_model,
            num_heads=heads,
            num_layers=setting(hf, "num_hidden_layers", source),
            d_ff=setting(hf, "intermediate_size", source),
            max_seq_len=setting(hf, "max_position_embeddings", source),
            position="learned",
            activation=activation(hf, "hidden_act", source, "gelu"),
            layer_norm_eps=setting(hf, "layer_norm_eps", source, 1e-12),
            norm_first=False,
            type_vocab_size=setting(hf, "type_vocab_size", source, 2),
            embed_norm=True,
            embed_scale=False,
            pooler=True,
            pad_id=hf.get("pad_token_id"),
        )

    def keys(self, cfg: TransformerConfig) -> KeyTable:
        keys = [
            Key("embed.tokens.weight", ("embeddings.word_embeddings.weight",)),
            Key("embed.positions.table.weight", ("embeddings.position_embeddings.weight",)),
            Key("embed.token_types.weight", ("embeddings.token_type_embeddings.weight",)),
            Key("embed.norm.weight", ("embeddings.LayerNorm.weight",)),
            Key("embed.norm.bias", ("embeddings.LayerNorm.bias",)),
            *per_layer(cfg.num_layers, _layer(cfg.d_model)),
        ]
        pooler = [
            Key("pooler.dense.weight", ("pooler.dense.weight",)),
            Key("pooler.dense.bias", ("pooler.dense.bias",)),
        ]
        heads = (r"cls\..*", r"classifier\..*", r"qa_outputs\..*")  # BertFor...'s task heads
        return KeyTable(keys + (pooler if cfg.pooler else []), ignored=(r"embeddings\.position_ids", *heads))

    def fit(self, cfg: TransformerConfig, names: set[str]) -> TransformerConfig:
        """No pooler where the file has none (``BertForMaskedLM``, ``add_pooling_layer=False``)."""
        return cfg if "pooler.dense.weight" in names else cfg.replace(pooler=False)

    def rename(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """``BertFor...`` files prefix the encoder's tensors with ``bert.``."""
        return {n.removeprefix("bert."): t for n, t in tensors.items()}

    def mismatches(self, cfg: TransformerConfig) -> list[str]:
        wrong = differences(cfg, SHAPE, "BERT")
        if cfg.type_vocab_size < 1:
            wrong.append(f"TransformerConfig.type_vocab_size={cfg.type_vocab_size} (BERT needs token types)")
        return wrong

    def hf_config(self, cfg: TransformerConfig, generation: GenerationIds) -> dict[str, Any]:
        return {
            "model_type": "bert",
            "architectures": [self.architecture],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_attention_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers,
            "intermediate_size": cfg.d_ff,
            "max_position_embeddings": cfg.max_seq_len,
            "type_vocab_size": cfg.type_vocab_size,
            "hidden_act": reverse_activation(cfg.activation),
            "layer_norm_eps": cfg.layer_norm_eps,
            "hidden_dropout_prob": cfg.dropout,
            "attention_probs_dropout_prob": cfg.dropout,
            "pad_token_id": cfg.pad_id if cfg.pad_id is not None else generation.pad,
        }
