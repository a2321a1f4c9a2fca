"""GPT-2 (``GPT2LMHeadModel``): Pre-LN blocks and a final LN, learned positions, the tanh GELU, a tied head.

Its ``Conv1D`` layers store weights ``[in, out]`` (transposed against ``nn.Linear``), and ``c_attn`` holds q, k, v
fused in tformer's own row order. Files without the ``transformer.`` prefix (the original release) and with the
causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` load too.
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

P = "transformer."
LAYER = [
    Key("decoder.stack.blocks.{i}.self_attn_norm.weight", (P + "h.{i}.ln_1.weight",)),
    Key("decoder.stack.blocks.{i}.self_attn_norm.bias", (P + "h.{i}.ln_1.bias",)),
    Key("decoder.stack.blocks.{i}.self_attn.in_proj.weight", (P + "h.{i}.attn.c_attn.weight",), transpose=True),
    Key("decoder.stack.blocks.{i}.self_attn.in_proj.bias", (P + "h.{i}.attn.c_attn.bias",)),
    Key("decoder.stack.blocks.{i}.self_attn.out_proj.weight", (P + "h.{i}.attn.c_proj.weight",), transpose=True),
    Key("decoder.stack.blocks.{i}.self_attn.out_proj.bias", (P + "h.{i}.attn.c_proj.bias",)),
    Key("decoder.stack.blocks.{i}.ff_norm.weight", (P + "h.{i}.ln_2.weight",)),
    Key("decoder.stack.blocks.{i}.ff_norm.bias", (P + "h.{i}.ln_2.bias",)),
    Key("decoder.stack.blocks.{i}.ff.up.weight", (P + "h.{i}.mlp.c_fc.weight",), transpose=True),
    Key("decoder.stack.blocks.{i}.ff.up.bias", (P + "h.{i}.mlp.c_fc.bias",)),
    Key("decoder.stack.blocks.{i}.ff.down.weight", (P + "h.{i}.mlp.c_proj.weight",), transpose=True),
    Key("decoder.stack.blocks.{i}.ff.down.bias", (P + "h.{i}.mlp.c_proj.bias",)),
]
SHAPE = dict(
    position="learned",
    norm="layer",
    ffn="mlp",
    norm_first=True,
    bias=True,
    qkv_bias=(None, True),
    tie_embeddings=True,
    num_kv_heads=(None,),
    type_vocab_size=0,
    embed_norm=False,
    embed_scale=(None, False),
    logits_bias=False,
    pooler=False,
)


class GPT2(Family):
    name, architecture, model_types, kind = "gpt2", "GPT2LMHeadModel", ("gpt2",), "lm"

    def config(self, hf: dict[str, Any], source: str) -> TransformerConfig:
        d_model, heads = setting(hf, "n_embd", source), setting(hf, "n_head", source)
        head_dim_must_split(hf, d_model, heads, source)
        for name in ("scale_attn_by_inverse_layer_idx",):
            refuse(bool(hf.get(name)), source, name, hf.get(name), "GPT-2's attention here scales by 1/sqrt(d_k) only")
        refuse(hf.get("scale_attn_weights") is False, source, "scale_attn_weights", False, "attention is scaled")
        refuse(hf.get("tie_word_embeddings") is False, source, "tie_word_embeddings", False, "GPT-2's head is tied")
        return TransformerConfig(
            vocab_size=setting(hf, "vocab_size", source),
            d_model=d_model,
            num_heads=heads,
            num_layers=setting(hf, "n_layer", source),
            d_ff=setting(hf, "n_inner", source, 4 * d_model),
            max_seq_len=setting(hf, "n_positions", source),
            position="learned",
            activation=activation(hf, "activation_function", source, "gelu_new"),
            layer_norm_eps=setting(hf, "layer_norm_epsilon", source, 1e-5),
            norm_first=True,
            tie_embeddings=True,
        )

    def keys(self, cfg: TransformerConfig) -> KeyTable:
        keys = [
            Key("decoder.embed.tokens.weight", (P + "wte.weight",)),
            Key("decoder.embed.positions.table.weight", (P + "wpe.weight",)),
            *per_layer(cfg.num_layers, LAYER),
            Key("decoder.stack.final_norm.weight", (P + "ln_f.weight",)),
            Key("decoder.stack.final_norm.bias", (P + "ln_f.bias",)),
        ]
        masks = (r"transformer\.h\.\d+\.attn\.(masked_)?bias",)  # the causal-mask buffers of old files
        return KeyTable(keys, ignored=masks, aliases={"lm_head.weight": P + "wte.weight"})

    def rename(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Files of the original release have no ``transformer.`` prefix."""
        return {n if n.startswith(P) or n.startswith("lm_head.") else P + n: t for n, t in tensors.items()}

    def mismatches(self, cfg: TransformerConfig) -> list[str]:
        return differences(cfg, SHAPE, "GPT-2")

    def hf_config(self, cfg: TransformerConfig, generation: GenerationIds) -> dict[str, Any]:
        act = reverse_activation(cfg.activation, {"gelu_tanh": "gelu_new"})
        return {
            "model_type": "gpt2",
            "architectures": [self.architecture],
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model,
            "n_head": cfg.num_heads,
            "n_layer": cfg.num_layers,
            "n_inner": cfg.d_ff,
            "n_positions": cfg.max_seq_len,
            "activation_function": act,
            "layer_norm_epsilon": cfg.layer_norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "tie_word_embeddings": True,
            "bos_token_id": generation.bos,
            "eos_token_id": generation.eos_id,
            "pad_token_id": generation.pad,
        }
